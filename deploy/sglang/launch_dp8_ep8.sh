#!/usr/bin/env bash
# DeepSeek-V3 on ONE 8xH200 node: data-parallel attention (8 ranks, each its own requests and its own KV pool)
# + expert-parallel MoE (EP=8, DeepEP all-to-all). Front it with kvrouter: deploy/sglang/router-dp8.yaml.
#
# Flags (every one is in deploy/flags/sglang_flags.txt, read from SGLang 0.5.21 and 0.5.23 source):
#   --model-path, --trust-remote-code, --context-length, --kv-cache-dtype   sglang/srt/arg_groups/fields/model.py
#   --host, --port, --served-model-name, --enable-cache-report              sglang/srt/arg_groups/fields/serving.py
#   --tp-size, --dp-size, --ep-size                                          sglang/srt/arg_groups/fields/parallel.py
#   --enable-dp-attention   sglang/srt/arg_groups/fields/parallel.py (0.5.21); deprecated alias registered in
#                           sglang/srt/server_args.py (0.5.23: becomes --attn-dp-size 8, dp_size 1; until 2026-12-31)
#   --moe-a2a-backend, --deepep-mode, --attention-backend                    sglang/srt/arg_groups/fields/exec_.py
#   --page-size, --mem-fraction-static, --max-running-requests,
#   --chunked-prefill-size, --max-queued-requests                            sglang/srt/arg_groups/fields/schedule.py
#   --enable-metrics, --decode-log-interval                                  sglang/srt/arg_groups/fields/observability.py
#
# Capacity numbers: `kvrouter plan --model deepseek-v3 --gpu h200 --gpus 8 --page-size 64 --json`
# (deploy/README.md, "Recomputing the numbers"):
#   --mem-fraction-static 0.86   SGLang's fraction is (weights + KV pool) / total GPU memory as CUDA reports it
#                                (H200: 143,771 MiB = 150.75 GB). The plan's usable budget is 0.92 x 141 GB =
#                                129.72 GB -> 129.72 / 150.75 = 0.860. The rest (~21 GB) holds activations,
#                                CUDA graphs and DeepEP buffers; SGLang's own default here is ~0.858.
#                                Plan: 93.9 GB weights + 35.9 GB KV per GPU -> 510,208 tokens per rank (page 64).
#   --context-length 163840      the model's max_position_embeddings; it must be <= one rank's pool (510,208),
#                                because a sequence never straddles DP ranks.
#   --max-running-requests 992   plan dp_ep.seqs_at_context at 4,096-token contexts = 8 x floor(510,208 / 4,096).
#                                SGLang divides it by the DP size: 124 per rank. The router's ledger, not this
#                                cap, is the admission control; the cap stops the engine from over-admitting.
#   --chunked-prefill-size 8192  the H200 default, divided by the DP size under DP attention: 1,024 prompt
#                                tokens per rank per step. Ranks run in lockstep, so one rank's chunk (~100 ms)
#                                delays every rank's decode step: keep it small.
#   --page-size 64               FlashMLA's page; the router rounds every reservation up to it.
set -euo pipefail

MODEL="${MODEL:-deepseek-ai/DeepSeek-V3}"
HOST="${HOST:-0.0.0.0}"
PORT="${PORT:-30000}"

exec python3 -m sglang.launch_server \
  --model-path "${MODEL}" \
  --served-model-name "${SERVED_MODEL_NAME:-deepseek-ai/DeepSeek-V3}" \
  --trust-remote-code \
  --host "${HOST}" \
  --port "${PORT}" \
  --tp-size 8 \
  --dp-size 8 \
  --enable-dp-attention \
  --ep-size 8 \
  --moe-a2a-backend deepep \
  --deepep-mode auto \
  --attention-backend flashmla \
  --page-size 64 \
  --kv-cache-dtype auto \
  --mem-fraction-static "${MEM_FRACTION_STATIC:-0.86}" \
  --context-length "${CONTEXT_LENGTH:-163840}" \
  --max-running-requests "${MAX_RUNNING_REQUESTS:-992}" \
  --chunked-prefill-size "${CHUNKED_PREFILL_SIZE:-8192}" \
  --max-queued-requests "${MAX_QUEUED_REQUESTS:-4096}" \
  --enable-metrics \
  --enable-cache-report \
  --decode-log-interval 10
