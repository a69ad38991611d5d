#!/usr/bin/env bash
# DeepSeek-V3 on ONE 8xH200 node with vLLM 0.33, EXTERNAL load balancing: one `vllm serve` per DP rank, each on
# its own GPU and port (8000 + rank), all joined into one DP=8 / EP=8 group through rank 0's coordinator
# (--data-parallel-address/--data-parallel-rpc-port). The rank IS the URL: kvrouter sends no pin header.
# This is the one-process-per-rank shape that one-pod-per-rank Kubernetes setups use (llm-d's targetPorts).
# Router: deploy/vllm/router-external-lb.yaml.
#
# Flags as in serve_dp8_internal_lb.sh, plus (vllm/engine/arg_utils.py over vllm/config/parallel.py):
#   --data-parallel-rank, --data-parallel-external-lb, --data-parallel-address, --data-parallel-rpc-port
# Capacity numbers: same per-rank numbers as serve_dp8_internal_lb.sh (each process is one rank).
# Stop: Ctrl-C or SIGTERM stops all eight.
set -euo pipefail

MODEL="${MODEL:-deepseek-ai/DeepSeek-V3}"
BASE_PORT="${BASE_PORT:-8000}"
DP_SIZE=8

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait' INT TERM EXIT

for rank in $(seq 0 $((DP_SIZE - 1))); do
  CUDA_VISIBLE_DEVICES="${rank}" vllm serve "${MODEL}" \
    --served-model-name "${SERVED_MODEL_NAME:-deepseek-ai/DeepSeek-V3}" \
    --trust-remote-code \
    --host "${HOST:-0.0.0.0}" \
    --port "$((BASE_PORT + rank))" \
    --tensor-parallel-size 1 \
    --data-parallel-size "${DP_SIZE}" \
    --data-parallel-rank "${rank}" \
    --data-parallel-external-lb \
    --data-parallel-address "${DP_ADDRESS:-127.0.0.1}" \
    --data-parallel-rpc-port "${DP_RPC_PORT:-13345}" \
    --enable-expert-parallel \
    --all2all-backend "${ALL2ALL_BACKEND:-allgather_reducescatter}" \
    --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-0.92}" \
    --max-model-len "${MAX_MODEL_LEN:-163840}" \
    --max-num-seqs "${MAX_NUM_SEQS:-124}" \
    --max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-2048}" \
    --block-size 64 \
    --kv-cache-dtype auto \
    --enable-prefix-caching \
    --enable-prompt-tokens-details &
  pids+=("$!")
done
wait -n "${pids[@]}"
