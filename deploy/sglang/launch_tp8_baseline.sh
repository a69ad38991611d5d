#!/usr/bin/env bash
# Baseline for comparison: DeepSeek-V3 on one 8xH200 node with tensor parallelism everywhere (TP=8, no DP
# attention). MLA's latent is shared by every head, so TP does NOT divide the KV cache: every GPU holds every
# token and the node has ONE pool. Front it with kvrouter using deploy/sglang/router-tp8.yaml (one rank).
#
# Flags: see launch_dp8_ep8.sh for the source files (all in deploy/flags/sglang_flags.txt).
#
# Capacity numbers: `kvrouter plan --model deepseek-v3 --gpu h200 --gpus 8 --page-size 64 --json`, layout tp:
#   83.9 GB weights + 45.8 GB KV per GPU -> 652,288 tokens for the whole node (vs 4,081,664 with DP attention:
#   6.26x). --max-running-requests 159 = plan tp.seqs_at_context at 4,096-token contexts.
#   --mem-fraction-static 0.86 keeps the same 129.72 GB budget as the DP recipe so the two compare fairly.
#   --chunked-prefill-size 8192 is not divided (one scheduler).
set -euo pipefail

MODEL="${MODEL:-deepseek-ai/DeepSeek-V3}"

exec python3 -m sglang.launch_server \
  --model-path "${MODEL}" \
  --served-model-name "${SERVED_MODEL_NAME:-deepseek-ai/DeepSeek-V3}" \
  --trust-remote-code \
  --host "${HOST:-0.0.0.0}" \
  --port "${PORT:-30000}" \
  --tp-size 8 \
  --attention-backend flashmla \
  --page-size 64 \
  --kv-cache-dtype auto \
  --mem-fraction-static "${MEM_FRACTION_STATIC:-0.86}" \
  --context-length "${CONTEXT_LENGTH:-163840}" \
  --max-running-requests "${MAX_RUNNING_REQUESTS:-159}" \
  --chunked-prefill-size "${CHUNKED_PREFILL_SIZE:-8192}" \
  --max-queued-requests "${MAX_QUEUED_REQUESTS:-4096}" \
  --enable-metrics \
  --enable-cache-report \
  --decode-log-interval 10
