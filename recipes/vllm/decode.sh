#!/usr/bin/env bash
# GLM-5.3-FP8 decode instance on one 8xH200 node (or two 8xH100 nodes), GlmPdConnector as kv_consumer.
# Decode reads each request's suffix from the prefill address that arrives in its kv_transfer_params.
set -euo pipefail
: "${GLM_PD_CREDENTIAL:?the deployment key file from glm-pd keygen DIR (its .key_secret), the same on every node}"
MODEL=${MODEL:-zai-org/GLM-5.3-FP8}
PORT=${PORT:-8200}
VLLM=${VLLM:-vllm}
source "$(dirname "$0")/nodes.sh"  # NNODES, NODE_RANK, MASTER_ADDR -> TP and the multi-node flags
# Context parallelism: each of the 8 ranks holds every 8th token (7.2 GB of a 1M-token request, not 57.4 GB,
# which an H200 cannot hold beside its 89 GB of weights). DCP=1 (replicated) fits a B200. glm-pd reads
# each decode rank's tokens from the prefill rank holding them: one copy over the network in all.
DCP=${DCP:-8}

# Under Mooncake decode's transport binds this node's address too (NIXL needs none on decode).
if [ -n "${NODE_IP:-}" ]; then export GLM_PD_SIDE_CHANNEL_HOST=$NODE_IP; fi
export UCX_TLS=${UCX_TLS:-rc,cuda_ipc,cuda_copy}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1,mlx5_4:1,mlx5_5:1,mlx5_6:1,mlx5_7:1}

# Prefix caching stays on: a decode-side prefix hit (page-aligned) means only the suffix travels.
exec "$VLLM" serve "$MODEL" \
  --served-model-name glm-5.3 \
  --host 0.0.0.0 --port "$PORT" \
  --tensor-parallel-size "$TP" "${multinode[@]}" \
  --decode-context-parallel-size "$DCP" \
  --kv-cache-dtype fp8 \
  --block-size 64 \
  --max-model-len 1048576 \
  --gpu-memory-utilization 0.92 \
  --enable-prefix-caching \
  --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}' \
  --kv-transfer-config "{\"kv_connector\": \"GlmPdConnector\", \"kv_connector_module_path\": \"glm_pd_vllm.connector\",
    \"kv_role\": \"kv_consumer\", \"kv_connector_extra_config\": {\"credential\": \"$GLM_PD_CREDENTIAL\",
    \"transport\": \"nixl\", \"timeout_s\": 60}}"
