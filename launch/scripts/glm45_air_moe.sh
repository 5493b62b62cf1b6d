#!/usr/bin/env bash
# Recipe: GLM-4.5-Air GRPO with routing replay on four 8-GPU nodes (examples/configs/glm45_air.yaml), expert
# parallelism on both sides. Start workers as in multi_node.sh, then on the head node:
#   MODEL_PATH=/models/GLM-4.5-Air launch/scripts/glm45_air_moe.sh [--dry-run] [more sluice args...]
# (NUM_NODES=4: two nodes of engines, two of trainer ranks)
set -euo pipefail
HERE="$(dirname "$0")"
MODEL_PATH=${MODEL_PATH:-/models/GLM-4.5-Air}

MEGATRON_ARGS=(
  --tensor-model-parallel-size 4        # dense layers: TP=4 (8 KV heads), PP=2 (23 layers a stage), DP=2
  --pipeline-model-parallel-size 2
  --expert-model-parallel-size 8        # 128 experts spread over each stage's 8 trainer ranks, 16 each
  --expert-tensor-parallel-size 1       # experts are not tensor-split
  --sequence-parallel                   # required by megatron-core for MoE with TP > 1
  --optimizer-cpu-offload               # main weights and Adam moments in host memory
  --moe-token-dispatcher-type alltoall
  --moe-router-dtype fp32
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --no-use-cpu-initialization
)
SGLANG_ARGS=(
  --sglang-ep-size 8                    # experts split across each engine's 8 GPUs
  --sglang-mem-fraction-static 0.8
  --sglang-enable-memory-saver
)
ROUTER_ARGS=(
  --router-request-timeout-secs 3600
)

NUM_NODES=${NUM_NODES:-4} CONFIG=examples/configs/glm45_air.yaml exec "$HERE/multi_node.sh" model.path="$MODEL_PATH" \
  "${MEGATRON_ARGS[@]}" "${SGLANG_ARGS[@]}" "${ROUTER_ARGS[@]}" "$@"
