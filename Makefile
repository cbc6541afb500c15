# Two commands set everything up: `make demo` (the main job) and `make test` (the whole suite).
SHELL := /bin/bash
CORE_REQS := requirements/core.txt

.PHONY: demo test core-venv lint

core-venv:
	@venv=$$(scripts/venv.sh core $(CORE_REQS)) && $$venv/bin/python -m pip install -q --no-deps -e . \
	  && echo $$venv > .venv-core-path

demo: core-venv
	$$(cat .venv-core-path)/bin/glm-pd plan --preset glm-5.3 --tokens 1M

lint: core-venv
	$$(cat .venv-core-path)/bin/ruff check .

test: lint
	$$(cat .venv-core-path)/bin/python -m pytest -q tests
