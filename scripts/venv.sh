#!/usr/bin/env bash
# Usage: scripts/venv.sh NAME REQUIREMENTS...  -> prints the path of a ready virtual environment.
# Venvs live outside the checkout, keyed by a hash of their pinned requirements and the Python version,
# so a rerun on the same machine reuses them while a fresh machine builds everything.
set -euo pipefail
name=$1; shift
root=${GLM_PD_VENV_ROOT:-$HOME/.cache/glm-pd/venvs}
py=${GLM_PD_PYTHON:-python3}
key=$( { "$py" -c 'import sys; print(sys.version)'; cat "$@"; } | sha256sum | cut -c1-16)
venv=$root/$name-$key
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$root"
  "$py" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  for req in "$@"; do
    # A requirements file whose first line is '# --no-deps' is installed without dependency resolution.
    if head -1 "$req" | grep -q -- '--no-deps'; then
      "$venv/bin/python" -m pip install -q --no-deps -r "$req" >&2
    else
      "$venv/bin/python" -m pip install -q -r "$req" >&2
    fi
  done
  touch "$venv/.complete"
fi
echo "$venv"
