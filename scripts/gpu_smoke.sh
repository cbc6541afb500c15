#!/usr/bin/env bash
# The GPU smoke of issue 14 (tests/gpu/smoke.py) on a machine with CUDA and torch, the missing wheels installed as
# scripts/gpu_wheels.sh says; the GPU tests run within GLM_PD_GPU_TESTS_S (150 s) and the smoke within
# GLM_PD_SMOKE_S (270 s); 0 leaves either out (scripts/gpu_session.sh runs them apart).
#   scripts/gpu_smoke.sh [--pages N] [--json PATH]   run (JSON also lands in $OUT/gpu_smoke.json if OUT is set)
#   scripts/gpu_smoke.sh --fetch-wheels              where pip reaches PyPI: download those wheels (gpu_wheels.sh)
# Exit status: 77 skipped (no CUDA or a package missing, named); else the smoke's (0 passed, 1 a check failed, 124
# timeout), or the GPU tests' where the smoke passed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_wheels.sh "$@"
# Nothing is started where the smoke cannot run: it names what is missing.
python3 -c "import sys; from tests.gpu.smoke import unavailable; r = unavailable(); r and print('SKIPPED:', r); \
sys.exit(77 if r else 0)"
# The GPU tests first, newest code first (staging copies, glm-pd threads' own streams, device digests and the
# kernel, the grant event recorded before the forward, glm-pd threads' device (two GPUs), the GPU data path UCX
# picks (doctor's probe), the demo on GPU caches), under UCX's default settings; their results also land in
# $OUT/gpu_tests.xml. A failure there is reported, and the smoke still runs.
tests=0 tests_s=${GLM_PD_GPU_TESTS_S:-150} smoke_s=${GLM_PD_SMOKE_S:-270}
if [ "$tests_s" -gt 0 ]; then
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -k 10 "$tests_s" python3 -m pytest -q -p no:cacheprovider \
    -o addopts="--import-mode=importlib -ra --durations=0" ${OUT:+--junitxml "$OUT/gpu_tests.xml"} \
    tests/gpu/test_staged_device.py tests/gpu/test_thread_stream.py tests/gpu/test_device_digests.py \
    tests/gpu/test_grant_event.py tests/gpu/test_thread_device.py tests/gpu/test_datapath.py \
    tests/gpu/test_demo_device.py || tests=$?
fi
# The smoke reads pipelined (cuda_ipc for READ between GPUs without NVLink, FACTS.md section 9) unless set.
smoke=0
if [ "$smoke_s" -gt 0 ]; then
  UCX_RMA_PPLN_ENABLE=${UCX_RMA_PPLN_ENABLE:-y} timeout -k 10 "$smoke_s" python3 -m tests.gpu.smoke "$@" || smoke=$?
fi
echo "GPU tests: exit $tests; smoke: exit $smoke"
exit $((smoke != 0 ? smoke : tests))
