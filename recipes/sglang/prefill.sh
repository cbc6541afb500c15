#!/usr/bin/env bash
# GLM-5.3-FP8 SGLang prefill instance on one 8xH200 node, transfer backend glm-pd (Mooncake over RDMA).
set -euo pipefail
MODEL=${MODEL:-zai-org/GLM-5.3-FP8}
PORT=${PORT:-30000}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
PYTHON=${PYTHON:-python3}
export SGLANG_GLM_PD_TRANSPORT=${SGLANG_GLM_PD_TRANSPORT:-mooncake}

exec "$PYTHON" -m sglang.launch_server \
  --model-path "$MODEL" --served-model-name glm-5.3 \
  --host 0.0.0.0 --port "$PORT" \
  --tp 8 \
  --page-size 64 \
  --kv-cache-dtype fp8_e4m3 \
  --context-length 1048576 \
  --mem-fraction-static 0.85 \
  --disaggregation-mode prefill \
  --disaggregation-transfer-backend glm-pd \
  --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" \
  --disaggregation-ib-device "${IB_DEVICES:-mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7}"
