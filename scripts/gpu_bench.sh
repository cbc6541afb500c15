#!/usr/bin/env bash
# The GPU bench of issue 28 (benchmarks/gpu_bench.py) on a machine with CUDA and torch but no NIXL, vLLM or SGLang,
# and no network: the missing wheels travel in $GLM_PD_WHEELS (default .whl) and are installed into a private folder
# (the same wheels as scripts/gpu_smoke.sh; glm_pd_common is read from common/ as it lies). One command, the whole
# run within 360 s; prints a table and writes JSON (also to $OUT/gpu_bench.json when OUT is set).
#   scripts/gpu_bench.sh [--tokens N] [--repeats N] [--json PATH]   run (any option of the bench passes through)
#   scripts/gpu_bench.sh --fetch-wheels                             where pip reaches PyPI: fetch those wheels
# UCX's environment passes through and is recorded: e.g. UCX_RMA_PPLN_ENABLE=y lets cuda_ipc serve READs between
# GPUs without NVLink (FACTS.md §9). Exit status: the bench's (0 ran, 77 skipped: no CUDA, torch or a package;
# 124 timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  exec scripts/gpu_smoke.sh --fetch-wheels
fi
wheels=${GLM_PD_WHEELS:-.whl}
site=${GLM_PD_SITE:-/tmp/glm-pd-site}
mkdir -p "$site"
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
fi
export PYTHONPATH="$site:$PWD:$PWD/common${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export UCX_PROTO_INFO=${UCX_PROTO_INFO:-y}  # UCX prints the protocol it picks per operation: each row's path
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>/dev/null || true
exec timeout 360 python3 -m benchmarks.gpu_bench "$@"
