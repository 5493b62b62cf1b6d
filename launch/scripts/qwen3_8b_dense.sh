#!/usr/bin/env bash
# Recipe: dense Qwen3-8B-style GRPO on one 8-GPU node (examples/configs/qwen3_8b.yaml), with the Megatron and
# SGLang knobs given the way their users already write them. Add --dry-run to print the plan and exit.
#   MODEL_PATH=/models/Qwen3-8B launch/scripts/qwen3_8b_dense.sh [--dry-run] [more sluice args...]
set -euo pipefail
HERE="$(dirname "$0")"
MODEL_PATH=${MODEL_PATH:-/models/Qwen3-8B}

MEGATRON_ARGS=(
  --tensor-model-parallel-size 4        # trainer layout: TP=4 on 4 GPUs (cluster.trainer_gpus)
  --sequence-parallel                   # shard layer-norm/dropout activations along the sequence within TP
  --recompute-granularity selective     # recompute core attention in backward
  --attention-softmax-in-fp32
  --no-use-cpu-initialization           # GPU run: initialise on the device
  --gradient-accumulation-fusion        # fused wgrad accumulation (GPU kernels)
  --clip-grad 1.0                       # megatron's name for trainer.grad_clip
)
SGLANG_ARGS=(
  --sglang-mem-fraction-static 0.7      # leave room for the CUDA graphs and the weight-update buffers
  --sglang-chunked-prefill-size 8192
  --sglang-enable-memory-saver          # lets sluice release engine memory between phases
)
ROUTER_ARGS=(
  --router-request-timeout-secs 1800    # long rollouts
)

CONFIG=examples/configs/qwen3_8b.yaml exec "$HERE/single_node.sh" model.path="$MODEL_PATH" \
  "${MEGATRON_ARGS[@]}" "${SGLANG_ARGS[@]}" "${ROUTER_ARGS[@]}" "$@"
