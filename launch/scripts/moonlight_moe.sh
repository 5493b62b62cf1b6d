#!/usr/bin/env bash
# Recipe: Moonlight-16B-A3B GRPO with routing replay on two 8-GPU nodes (examples/configs/moonlight.yaml): the
# DeepSeek-V3 architecture (multi-latent attention, shared experts, sigmoid routing with an expert bias), its MLA
# and MoE flags as slime's scripts/models/moonlight.sh writes them, checked against config.json at start.
# Start workers as in multi_node.sh, then on the head node:
#   MODEL_PATH=/models/Moonlight-16B-A3B-Instruct launch/scripts/moonlight_moe.sh [--dry-run] [more sluice args...]
# (NUM_NODES=2: one node of engines, one of trainer ranks)
set -euo pipefail
HERE="$(dirname "$0")"
MODEL_PATH=${MODEL_PATH:-/models/Moonlight-16B-A3B-Instruct}

MODEL_ARGS=(                            # read from config.json anyway; a flag that differs is refused
  --multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
  --qk-layernorm --num-experts 64 --moe-ffn-hidden-size 1408 --moe-router-topk 6
  --moe-shared-expert-intermediate-size 2816 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-topk-scaling-factor 2.446
)
MEGATRON_ARGS=(
  --tensor-model-parallel-size 2        # 16 attention heads, 8 a rank; DP=4
  --expert-model-parallel-size 8        # 64 experts over the 8 trainer ranks, 8 each
  --expert-tensor-parallel-size 1       # experts are not tensor-split
  --sequence-parallel                   # required by megatron-core for MoE with TP > 1
  --moe-token-dispatcher-type alltoall
  --moe-router-dtype fp32
  --moe-router-bias-update-rate 0       # the engines keep routing by the checkpoint's expert bias
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --no-use-cpu-initialization
)
SGLANG_ARGS=(
  --sglang-mem-fraction-static 0.8
  --sglang-enable-memory-saver
)
ROUTER_ARGS=(
  --router-request-timeout-secs 3600
)

NUM_NODES=${NUM_NODES:-2} CONFIG=examples/configs/moonlight.yaml exec "$HERE/multi_node.sh" model.path="$MODEL_PATH" \
  "${MODEL_ARGS[@]}" "${MEGATRON_ARGS[@]}" "${SGLANG_ARGS[@]}" "${ROUTER_ARGS[@]}" "$@"
