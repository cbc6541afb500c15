#!/usr/bin/env bash
# What a session lent a GPU runs, in one call within GLM_PD_GPU_BUDGET_S (450 s: a device session has 15 minutes
# in all, its start included): the GPU tests, then the bench of issue 28 (scripts/gpu_bench.sh), then the
# two-process smoke at --pages 1024 in the time left (scripts/gpu_smoke.sh runs tests and smoke alone). Results
# land under $OUT: gpu_tests.xml, gpu_bench.json, gpu_smoke.json. Carry the wheels in .whl (fetch them where pip
# reaches PyPI: scripts/gpu_session.sh --fetch-wheels).
# Exit status: 77 skipped (the tests' check names what is missing), else the first part that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  exec scripts/gpu_smoke.sh --fetch-wheels
fi
budget=${GLM_PD_GPU_BUDGET_S:-450}
left() { echo $((budget - SECONDS)); }

GLM_PD_SMOKE_S=0 GLM_PD_GPU_TESTS_S=$((budget / 3)) scripts/gpu_smoke.sh
tests=$?
[ "$tests" -eq 77 ] && exit 77

# the bench gets what is left but 90 s for the smoke and 20 s for each part's start (imports, the check of what is
# installed); rows not started 80 s before its end are skipped (the last row, the report, the child's close)
bench_s=$(($(left) - 110))
bench=0
if [ "$bench_s" -gt 120 ]; then
  GLM_PD_BENCH_S=$bench_s scripts/gpu_bench.sh --deadline-s $((bench_s - 80))
  bench=$?
else
  echo "gpu_session: no time left for the bench"
fi

smoke_s=$(($(left) - 30))
smoke=0
if [ "$smoke_s" -gt 30 ]; then
  GLM_PD_GPU_TESTS_S=0 GLM_PD_SMOKE_S=$smoke_s scripts/gpu_smoke.sh --pages 1024
  smoke=$?
else
  echo "gpu_session: no time left for the smoke"
fi
echo "gpu_session: GPU tests exit $tests; bench exit $bench; smoke exit $smoke ($SECONDS s of $budget)"
for rc in "$tests" "$bench" "$smoke"; do
  [ "$rc" -ne 0 ] && exit "$rc"
done
exit 0
