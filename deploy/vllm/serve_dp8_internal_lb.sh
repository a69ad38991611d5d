#!/usr/bin/env bash
# DeepSeek-V3 on ONE 8xH200 node with vLLM 0.33: data-parallel attention (DP=8, TP=1 per rank, one KV pool
# per rank) + expert-parallel MoE, INTERNAL load balancing: one URL, and kvrouter pins each request with the
# X-data-parallel-rank header (vllm/entrypoints/generate/base/serving.py). Router: deploy/vllm/router-internal-lb.yaml.
#
# Flags (every one is in deploy/flags/vllm_flags.txt, read from the vLLM 0.33.0 wheel):
#   --tensor-parallel-size, --data-parallel-size, --enable-expert-parallel, --all2all-backend
#                                  vllm/engine/arg_utils.py (EngineArgs.add_cli_args) over vllm/config/parallel.py
#   --gpu-memory-utilization, --block-size, --kv-cache-dtype, --enable-prefix-caching
#                                  vllm/engine/arg_utils.py over vllm/config/cache.py
#   --max-model-len, --served-model-name, --trust-remote-code
#                                  vllm/engine/arg_utils.py over vllm/config/model.py
#   --max-num-seqs, --max-num-batched-tokens   vllm/engine/arg_utils.py over vllm/config/scheduler.py
#   --host, --port, --enable-prompt-tokens-details   vllm/entrypoints/common/cli_args.py (FrontendArgs)
#   --api-server-count                         vllm/entrypoints/common/cli_args.py (make_arg_parser)
#
# Capacity numbers (`kvrouter plan --model deepseek-v3 --gpu h200 --gpus 8 --page-size 64 --json`, dp_ep):
#   --gpu-memory-utilization 0.92  vLLM's fraction covers EVERYTHING the rank uses (weights, activations,
#                                  CUDA graphs, KV) of the memory CUDA reports (150.75 GB on an H200):
#                                  0.92 x 150.75 = 138.7 GB, minus ~9 GB of activations/graphs leaves about the
#                                  plan's 129.72 GB for weights (93.9 GB) + KV (35.9 GB) -> ~510k tokens per rank.
#                                  (SGLang's --mem-fraction-static excludes activations, hence 0.86 there.)
#   --max-model-len 163840         the model's max_position_embeddings; <= one rank's pool, since a sequence
#                                  never straddles DP ranks.
#   --max-num-seqs 124             PER RANK in vLLM (SGLang's cap is per server): plan dp_ep.seqs_at_context
#                                  992 / 8 ranks = floor(510,208 / 4,096).
#   --max-num-batched-tokens 2048  per rank per step, decode tokens included (~124) + a ~1.9k prefill chunk.
#                                  Ranks run in lockstep: a big chunk on one rank stalls every rank's decode.
#   --block-size 64                fixed so the router rounds reservations to the engine's block.
#   --all2all-backend              allgather_reducescatter (vLLM's default, needs no extra kernels); on an image
#                                  with DeepEP use deepep_low_latency for decode-heavy traffic.
set -euo pipefail

MODEL="${MODEL:-deepseek-ai/DeepSeek-V3}"

exec vllm serve "${MODEL}" \
  --served-model-name "${SERVED_MODEL_NAME:-deepseek-ai/DeepSeek-V3}" \
  --trust-remote-code \
  --host "${HOST:-0.0.0.0}" \
  --port "${PORT:-8000}" \
  --tensor-parallel-size 1 \
  --data-parallel-size 8 \
  --enable-expert-parallel \
  --all2all-backend "${ALL2ALL_BACKEND:-allgather_reducescatter}" \
  --api-server-count 8 \
  --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-0.92}" \
  --max-model-len "${MAX_MODEL_LEN:-163840}" \
  --max-num-seqs "${MAX_NUM_SEQS:-124}" \
  --max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-2048}" \
  --block-size 64 \
  --kv-cache-dtype auto \
  --enable-prefix-caching \
  --enable-prompt-tokens-details
