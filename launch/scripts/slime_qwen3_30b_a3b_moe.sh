#!/usr/bin/env bash
# Recipe: the run of qwen3_30b_a3b_moe.sh (MoE Qwen3-30B-A3B-style GRPO on two 8-GPU nodes, expert parallelism on
# both sides) written the way a slime script writes it: slime's argument groups, as slime spells them
# (docs/from_slime.md; sluice --help slime). Start workers as in multi_node.sh, then on the head node:
#   MODEL_PATH=/models/Qwen3-30B-A3B launch/scripts/slime_qwen3_30b_a3b_moe.sh [--dry-run] [more sluice args...]
set -euo pipefail
HERE="$(dirname "$0")"
MODEL_PATH=${MODEL_PATH:-/models/Qwen3-30B-A3B}

NLAYERS=48
MOE_LAYER_FREQ="[$(printf '1,%.0s' $(seq 2 "$NLAYERS"))1]"  # every layer is MoE, slime's string form
MODEL_ARGS=(   # Qwen3-30B-A3B's shape as slime's scripts/models/qwen3-30B-A3B.sh gives it; checked against config.json
  --disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 32 --num-query-groups 4
  --kv-channels 128 --num-layers "$NLAYERS" --hidden-size 2048 --ffn-hidden-size 6144 --normalization RMSNorm
  --position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu
  --untie-embeddings-and-output-weights --vocab-size 151936 --rotary-base 1000000
  --moe-ffn-hidden-size 768 --moe-router-topk 8 --moe-layer-freq "$MOE_LAYER_FREQ" --num-experts 128
  --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 --moe-permute-fusion
)
CLUSTER_ARGS=( # trainer on node 1's 8 GPUs, 2 engines x TP 4 on node 0's
  --actor-num-nodes 1 --actor-num-gpus-per-node 8 --rollout-num-gpus 8 --num-gpus-per-node 8
)
CKPT_ARGS=(
  --hf-checkpoint "$MODEL_PATH"
  --save runs/qwen3-30b-a3b-grpo --save-interval 50
)
ROLLOUT_ARGS=(
  --prompt-data /data/math/train.jsonl --input-key problem --label-key answer --apply-chat-template --rollout-shuffle
  --rm-type math
  --num-rollout 200 --rollout-batch-size 64 --n-samples-per-prompt 8
  --rollout-max-prompt-len 1024 --rollout-max-response-len 2048 --rollout-temperature 1
  --global-batch-size 512
  --dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
)
EVAL_ARGS=(
  --eval-interval 20 --eval-prompt-data math /data/math/test.jsonl --n-samples-per-eval-prompt 4
  --eval-temperature 0.6
)
PERF_ARGS=(
  --tensor-model-parallel-size 4 --sequence-parallel   # DP = 8 GPUs / TP 4 = 2, derived as slime derives it
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --micro-batch-size 2 --no-use-cpu-initialization
)
GRPO_ARGS=(
  --advantage-estimator grpo --eps-clip 0.2 --calculate-per-token-loss
)
OPTIMIZER_ARGS=(
  --optimizer adam --lr 1e-6
)
SGLANG_ARGS=(
  --rollout-num-gpus-per-engine 4
  --sglang-ep-size 4 --sglang-mem-fraction-static 0.75 --sglang-moe-a2a-backend none --sglang-enable-memory-saver
  --router-request-timeout-secs 3600
)
SLUICE_ARGS=( # what slime has no argument for
  rollout.task_args.system_prompt="Reason step by step, then put the final answer in \\boxed{}."
  eval.num_prompts=256 "eval.pass_at_k=[1, 4]" sync.backend=nccl
  run.ray_address=auto                  # the Ray cluster multi_node.sh starts on every node
)

CONFIG="" exec "$HERE/multi_node.sh" "${MODEL_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" \
  "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "${SLUICE_ARGS[@]}" \
  "$@"
