#!/usr/bin/env bash
# The GPU smoke of issue 14 (tests/gpu/smoke.py) on a machine with CUDA and torch but no NIXL, vLLM or
# SGLang, and no network: the missing wheels travel in $GLM_PD_WHEELS (default .whl) and are installed into
# a private folder, and the GPU tests run within 150 s and the smoke within 420 s (glm_pd_common is read from common/ as it lies).
#   scripts/gpu_smoke.sh [--pages N] [--json PATH]   run (JSON also lands in $OUT/gpu_smoke.json if OUT is set)
#   scripts/gpu_smoke.sh --fetch-wheels              where pip reaches PyPI: download those wheels for the GPU
#                                                    machine's Python ($GLM_PD_GPU_PYTHON, default 3.12)
# Exit status: the smoke's (0 passed, 1 a check failed, 77 skipped: no CUDA or a package missing; 124 timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${GLM_PD_WHEELS:-.whl}

if [ "${1:-}" = "--fetch-wheels" ]; then
  # numpy and xxhash are in the GPU image already; NIXL, msgspec, pyzmq and pytest are not (versions as requirements/).
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GLM_PD_GPU_PYTHON:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$wheels" nixl==1.5.1 nixl-cu13==1.5.1 msgspec==0.23.0 pyzmq==27.3.0
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GLM_PD_GPU_PYTHON:-3.12}" \
    -d "$wheels" pytest==9.2.0 pluggy iniconfig packaging pygments
  du -sh "$wheels"
  exit 0
fi

site=${GLM_PD_SITE:-/tmp/glm-pd-site}
mkdir -p "$site"
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
fi
export PYTHONPATH="$site:$PWD:$PWD/common${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export UCX_PROTO_INFO=${UCX_PROTO_INFO:-y}  # UCX prints the protocol it picks (cuda_ipc, or a fallback)
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>/dev/null || true
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
