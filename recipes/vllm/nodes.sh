# Sourced by prefill.sh and decode.sh: how many nodes one instance spans.
# An instance may span nodes (H100: GLM-5.3-FP8's ~712 GB of weights need TP 16 over two 8-GPU nodes): run this
# script on each node with NNODES=2, NODE_RANK=0|1 and MASTER_ADDR (node 0's address); node 1 runs headless.
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
TP=$((8 * NNODES))
multinode=()
if [ "$NNODES" -gt 1 ]; then
  : "${MASTER_ADDR:?the address of node 0, where the workers of every node meet}"
  multinode=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR")
  if [ "$NODE_RANK" -gt 0 ]; then multinode+=(--headless); fi
fi
