#!/usr/bin/env bash
# Recipe: the run of qwen3_8b_dense.sh (dense Qwen3-8B-style GRPO on one 8-GPU node, disaggregated) written the way a
# slime script writes it: slime's argument groups, as slime spells them (docs/from_slime.md; sluice --help slime).
# Sluice-only settings ride along as section.key=value overrides. Add --dry-run to print the plan and exit.
#   MODEL_PATH=/models/Qwen3-8B launch/scripts/slime_qwen3_8b_dense.sh [--dry-run] [more sluice args...]
set -euo pipefail
HERE="$(dirname "$0")"
MODEL_PATH=${MODEL_PATH:-/models/Qwen3-8B}

MODEL_ARGS=(   # Qwen3-8B's shape as slime's scripts/models/qwen3-8B.sh gives it; sluice checks each against config.json
  --swiglu --num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear
  --normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128
  --qk-layernorm --untie-embeddings-and-output-weights
)
CLUSTER_ARGS=( # trainer on 4 GPUs, 2 engines x TP 2 on the other 4 of the node
  --actor-num-nodes 1 --actor-num-gpus-per-node 4 --rollout-num-gpus 4 --num-gpus-per-node 8
)
CKPT_ARGS=(
  --hf-checkpoint "$MODEL_PATH"
  --save runs/qwen3-8b-grpo             # the run folder; the same --load continues from its latest checkpoint
  --save-interval 50
)
ROLLOUT_ARGS=( # rows {"problem": ..., "answer": ...}, chat-templated, scored by Math-Verify on the \boxed{} answer
  --prompt-data /data/math/train.jsonl --input-key problem --label-key answer --apply-chat-template --rollout-shuffle
  --rm-type math
  --num-rollout 200 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-prompt-len 1024 --rollout-max-response-len 1024 --rollout-temperature 1
  --global-batch-size 256               # one optimizer step per rollout
  --dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
)
EVAL_ARGS=(
  --eval-interval 20 --eval-prompt-data math /data/math/test.jsonl --n-samples-per-eval-prompt 4
  --eval-temperature 0.6
)
PERF_ARGS=(
  --tensor-model-parallel-size 4 --sequence-parallel --recompute-granularity selective --micro-batch-size 4
  --attention-softmax-in-fp32 --no-use-cpu-initialization --gradient-accumulation-fusion --bf16
)
GRPO_ARGS=(
  --advantage-estimator grpo --eps-clip 0.2 --calculate-per-token-loss
)
OPTIMIZER_ARGS=(
  --optimizer adam --lr 1e-6 --clip-grad 1.0
)
SGLANG_ARGS=(
  --rollout-num-gpus-per-engine 2
  --sglang-mem-fraction-static 0.7 --sglang-chunked-prefill-size 8192 --sglang-enable-memory-saver
  --router-request-timeout-secs 1800
)
SLUICE_ARGS=( # what slime has no argument for
  rollout.task_args.system_prompt="Reason step by step, then put the final answer in \\boxed{}."
  eval.num_prompts=256 "eval.pass_at_k=[1, 4]" sync.backend=nccl
)

CONFIG="" exec "$HERE/single_node.sh" "${MODEL_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" \
  "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "${SLUICE_ARGS[@]}" \
  "$@"
