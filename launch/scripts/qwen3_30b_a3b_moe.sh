#!/usr/bin/env bash
# Recipe: MoE Qwen3-30B-A3B-style GRPO on two 8-GPU nodes (examples/configs/qwen3_30b_a3b.yaml) with expert
# parallelism on both sides. Start workers as in multi_node.sh, then on the head node:
#   MODEL_PATH=/models/Qwen3-30B-A3B launch/scripts/qwen3_30b_a3b_moe.sh [--dry-run] [more sluice args...]
set -euo pipefail
HERE="$(dirname "$0")"
MODEL_PATH=${MODEL_PATH:-/models/Qwen3-30B-A3B}

MEGATRON_ARGS=(
  --tensor-model-parallel-size 4        # dense layers: TP=4 (Qwen3-30B-A3B has 4 KV heads), DP=2 over 8 GPUs
  --expert-model-parallel-size 8        # 128 experts spread over all 8 trainer ranks, 16 each
  --expert-tensor-parallel-size 1       # experts are not tensor-split
  --sequence-parallel                   # required by megatron-core for MoE with TP > 1
  --moe-token-dispatcher-type alltoall
  --moe-router-dtype fp32
  --moe-permute-fusion
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --no-use-cpu-initialization
)
SGLANG_ARGS=(
  --sglang-ep-size 4                    # experts split across each engine's 4 GPUs
  --sglang-mem-fraction-static 0.75
  --sglang-moe-a2a-backend none
  --sglang-enable-memory-saver
)
ROUTER_ARGS=(
  --router-request-timeout-secs 3600
)

CONFIG=examples/configs/qwen3_30b_a3b.yaml exec "$HERE/multi_node.sh" model.path="$MODEL_PATH" \
  "${MEGATRON_ARGS[@]}" "${SGLANG_ARGS[@]}" "${ROUTER_ARGS[@]}" "$@"
