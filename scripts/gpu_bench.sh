#!/usr/bin/env bash
# The GPU bench of issue 28 (benchmarks/gpu_bench.py) on a machine with CUDA and torch, the missing wheels installed
# as scripts/gpu_wheels.sh says. One command, the whole run within GLM_PD_BENCH_S (360 s; rows not started by the
# bench's --deadline-s, 300 s, are skipped); prints a table and writes JSON (also to $OUT/gpu_bench.json when OUT
# is set).
#   scripts/gpu_bench.sh [--tokens N] [--repeats N] [--json PATH]   run (any option of the bench passes through)
#   scripts/gpu_bench.sh --fetch-wheels                             where pip reaches PyPI: fetch those wheels
# UCX's environment passes through and is recorded. UCX_RMA_PPLN_ENABLE defaults to y here: it lets cuda_ipc serve
# READs between GPUs without NVLink (FACTS.md §9), where UCX's default emulates them over tcp at ~0.5 GB/s and the
# READ rows would time UCX's fallback, not glm-pd (UCX_RMA_PPLN_ENABLE=n measures that). A run that fails or runs
# out of time still writes what it measured ("incomplete" says why). Exit status: the bench's (0 ran, 77 skipped:
# no CUDA, torch or a package; 124 timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_wheels.sh "$@"
export UCX_RMA_PPLN_ENABLE=${UCX_RMA_PPLN_ENABLE:-y}
exec timeout -k 20 "${GLM_PD_BENCH_S:-360}" python3 -m benchmarks.gpu_bench "$@"
