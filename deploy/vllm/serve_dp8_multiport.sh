#!/usr/bin/env bash
# DeepSeek-V3 on ONE 8xH200 node with vLLM 0.33, external LB from ONE command: a node-local supervisor starts one
# API server per local rank on port = --port + local_rank (8000..8007), with aggregated /health, /ready and
# /readyz on --data-parallel-supervisor-port (vllm/entrypoints/launchers/dp_supervisor.py). kvrouter sees the
# same eight URLs as with serve_dp8_external_lb.sh: deploy/vllm/router-external-lb.yaml.
#
# Flags as in serve_dp8_internal_lb.sh, plus (vllm/engine/arg_utils.py over vllm/config/parallel.py):
#   --data-parallel-multi-port-external-lb, --data-parallel-size-local, --data-parallel-supervisor-port
# Capacity numbers: as in serve_dp8_internal_lb.sh.
set -euo pipefail

MODEL="${MODEL:-deepseek-ai/DeepSeek-V3}"

exec vllm serve "${MODEL}" \
  --served-model-name "${SERVED_MODEL_NAME:-deepseek-ai/DeepSeek-V3}" \
  --trust-remote-code \
  --host "${HOST:-0.0.0.0}" \
  --port "${BASE_PORT:-8000}" \
  --tensor-parallel-size 1 \
  --data-parallel-size 8 \
  --data-parallel-size-local 8 \
  --data-parallel-multi-port-external-lb \
  --data-parallel-supervisor-port "${SUPERVISOR_PORT:-9256}" \
  --enable-expert-parallel \
  --all2all-backend "${ALL2ALL_BACKEND:-allgather_reducescatter}" \
  --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-0.92}" \
  --max-model-len "${MAX_MODEL_LEN:-163840}" \
  --max-num-seqs "${MAX_NUM_SEQS:-124}" \
  --max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-2048}" \
  --block-size 64 \
  --kv-cache-dtype auto \
  --enable-prefix-caching \
  --enable-prompt-tokens-details
