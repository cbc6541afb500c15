#!/usr/bin/env bash
# GLM-5.3-FP8 SGLang decode instance on one 8xH200 node, transfer backend glm-pd.
set -euo pipefail
MODEL=${MODEL:-zai-org/GLM-5.3-FP8}
PORT=${PORT:-30001}
PYTHON=${PYTHON:-python3}
# A 1M-token request (57.4 GB of KV on every rank, replicated) fits a B200 node at TP 8; on H200 it needs TP 16
# over two nodes (TP=16 NNODES=2 NODE_RANK=0|1 DIST_INIT_ADDR=<node 0>:5000 on each): SGLang 0.5.23 refuses the
# sharded layouts that would fit one H200 node (see recipes/README.md).
TP=${TP:-8}
NNODES=${NNODES:-1}
MULTI_NODE=()
if [ "$NNODES" -gt 1 ]; then
  : "${NODE_RANK:?the rank of this node among the NNODES nodes of the instance}"
  : "${DIST_INIT_ADDR:?host:port of node 0 of the instance, for torch.distributed}"
  MULTI_NODE=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --dist-init-addr "$DIST_INIT_ADDR")
fi
export SGLANG_GLM_PD_TRANSPORT=${SGLANG_GLM_PD_TRANSPORT:-mooncake}
# Every rank's messages go only between holders of the deployment's key (glm-pd keygen DIR, its .key_secret).
export SGLANG_GLM_PD_CREDENTIAL=${SGLANG_GLM_PD_CREDENTIAL:-${GLM_PD_CREDENTIAL:?the deployment key file from glm-pd keygen DIR (its .key_secret), the same on every node}}

exec "$PYTHON" -m sglang.launch_server \
  --model-path "$MODEL" --served-model-name glm-5.3 \
  --host 0.0.0.0 --port "$PORT" \
  --tp "$TP" "${MULTI_NODE[@]}" \
  --page-size 64 \
  --kv-cache-dtype fp8_e4m3 \
  --context-length 1048576 \
  --mem-fraction-static 0.85 \
  --disaggregation-mode decode \
  --disaggregation-transfer-backend glm-pd \
  --disaggregation-ib-device "${IB_DEVICES:-mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7}"
