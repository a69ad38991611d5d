#!/usr/bin/env bash
# DeepSeek-V3 on TWO 8xH200 nodes: DP attention over 16 ranks + EP=16 MoE (DeepEP all-to-all over the
# inter-node fabric). Run this script on both nodes with NODE_RANK=0 and NODE_RANK=1 and the same
# DIST_INIT_ADDR (node 0's address:port). Only node 0 serves HTTP: point kvrouter at it
# (deploy/sglang/router-dp16-2nodes.yaml).
#
# Flags as in launch_dp8_ep8.sh, plus (sglang/srt/arg_groups/fields/parallel.py):
#   --nnodes, --node-rank, --dist-init-addr (alias --nccl-init-addr)
#
# Capacity numbers: `kvrouter plan --model deepseek-v3 --gpu h200 --gpus 16 --page-size 64 --json`:
#   MoE weights are now split 16 ways: 52.6 GB weights + 77.1 GB KV per GPU -> 1,096,832 tokens per rank,
#   17.5M in total. --max-running-requests 4272 = plan dp_ep.seqs_at_context (16 x 267 at 4,096 tokens).
#   --mem-fraction-static 0.86, --context-length 163840 and --chunked-prefill-size 16384 (1,024 per rank)
#   follow the single-node reasoning.
set -euo pipefail

: "${NODE_RANK:?set NODE_RANK=0 on the head node, 1 on the other}"
: "${DIST_INIT_ADDR:?set DIST_INIT_ADDR=<node-0 address>:5000 on both nodes}"
MODEL="${MODEL:-deepseek-ai/DeepSeek-V3}"

exec python3 -m sglang.launch_server \
  --model-path "${MODEL}" \
  --served-model-name "${SERVED_MODEL_NAME:-deepseek-ai/DeepSeek-V3}" \
  --trust-remote-code \
  --host "${HOST:-0.0.0.0}" \
  --port "${PORT:-30000}" \
  --nnodes 2 \
  --node-rank "${NODE_RANK}" \
  --dist-init-addr "${DIST_INIT_ADDR}" \
  --tp-size 16 \
  --dp-size 16 \
  --enable-dp-attention \
  --ep-size 16 \
  --moe-a2a-backend deepep \
  --deepep-mode auto \
  --attention-backend flashmla \
  --page-size 64 \
  --kv-cache-dtype auto \
  --mem-fraction-static "${MEM_FRACTION_STATIC:-0.86}" \
  --context-length "${CONTEXT_LENGTH:-163840}" \
  --max-running-requests "${MAX_RUNNING_REQUESTS:-4272}" \
  --chunked-prefill-size "${CHUNKED_PREFILL_SIZE:-16384}" \
  --max-queued-requests "${MAX_QUEUED_REQUESTS:-8192}" \
  --enable-metrics \
  --enable-cache-report \
  --decode-log-interval 10
