#!/usr/bin/env bash
# The GPU smoke of issue 14 (tests/gpu/smoke.py) on a machine with CUDA and torch, the missing wheels installed as
# scripts/gpu_wheels.sh says; the GPU tests run within 150 s and the smoke within 420 s.
#   scripts/gpu_smoke.sh [--pages N] [--json PATH]   run (JSON also lands in $OUT/gpu_smoke.json if OUT is set)
#   scripts/gpu_smoke.sh --fetch-wheels              where pip reaches PyPI: download those wheels (gpu_wheels.sh)
# Exit status: the smoke's (0 passed, 1 a check failed, 77 skipped: no CUDA or a package missing; 124 timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_wheels.sh "$@"
# The device digests, the fault injector's VRAM corruption, glm-pd threads' device (two GPUs), the grant
# event recorded before the forward, and the GPU data path UCX picks (doctor's probe) first (tests/gpu/test_*.py,
# ~30 s),
# where CUDA, torch and pytest are there (pytest travels with the wheels); then the smoke, which names what is missing.
if python3 -c "import msgspec, pytest, torch; assert torch.cuda.is_available()" 2>/dev/null; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" tests/gpu/test_device_digests.py \
    tests/gpu/test_thread_device.py tests/gpu/test_grant_event.py tests/gpu/test_datapath.py tests/gpu/test_demo_device.py \
    tests/gpu/test_staged_device.py \
    || exit 1
fi
exec timeout 420 python3 -m tests.gpu.smoke "$@"
