#!/usr/bin/env bash
# The PD proxy in front of vLLM: PREFILL_URLS and DECODE_URLS are space-separated lists.
#   1P1D: PREFILL_URLS=http://10.0.0.1:8100  DECODE_URLS=http://10.0.0.2:8200
#   2P2D: PREFILL_URLS="http://10.0.0.1:8100 http://10.0.0.3:8100"  DECODE_URLS="http://10.0.0.2:8200 http://10.0.0.4:8200"
set -euo pipefail
: "${PREFILL_URLS:?space-separated prefill base URLs}" "${DECODE_URLS:?space-separated decode base URLs}"
PYTHON=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/../router" && pwd)
# shellcheck disable=SC2086  # the URL lists split into arguments on purpose
exec "$PYTHON" "$here/pd_proxy.py" --host 0.0.0.0 --port "${PORT:-8000}" \
  --prefill $PREFILL_URLS --decode $DECODE_URLS --timeout-s "${TIMEOUT_S:-600}"
