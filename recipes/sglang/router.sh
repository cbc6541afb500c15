#!/usr/bin/env bash
# sglang-router in PD mode in front of glm-pd SGLang instances.
#   1P1D: PREFILLS=http://10.0.0.1:30000  DECODES=http://10.0.0.2:30001
#   2P2D: PREFILLS="http://10.0.0.1:30000 http://10.0.0.3:30000"  DECODES="http://10.0.0.2:30001 http://10.0.0.4:30001"
# Each prefill's bootstrap port (prefill.sh's BOOTSTRAP_PORT) is passed with its URL.
set -euo pipefail
: "${PREFILLS:?space-separated prefill URLs}" "${DECODES:?space-separated decode URLs}"
PYTHON=${PYTHON:-python3}
args=()
for url in $PREFILLS; do args+=(--prefill "$url" "${BOOTSTRAP_PORT:-8998}"); done
for url in $DECODES; do args+=(--decode "$url"); done
exec "$PYTHON" -m sglang_router.launch_router --pd-disaggregation "${args[@]}" \
  --host 0.0.0.0 --port "${PORT:-8000}" --prefill-policy cache_aware --decode-policy power_of_two
