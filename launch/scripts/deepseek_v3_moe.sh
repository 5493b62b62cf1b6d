#!/usr/bin/env bash
# Recipe: DeepSeek-V3 / R1 GRPO with routing replay on twenty 8-GPU nodes (examples/configs/deepseek_v3.yaml):
# engines of TP 16 over two nodes each, the trainer TP8 x PP4 x DP4 with EP32; slime's DeepSeek-V3 MODEL_ARGS
# (scripts/models/deepseek-v3.sh) as it writes them, checked against config.json at start. Start workers as in
# multi_node.sh, then on the head node:
#   MODEL_PATH=/models/DeepSeek-V3-bf16 launch/scripts/deepseek_v3_moe.sh [--dry-run] [more sluice args...]
set -euo pipefail
HERE="$(dirname "$0")"
MODEL_PATH=${MODEL_PATH:-/models/DeepSeek-V3-bf16}

MOE_LAYER_FREQ="[$(printf '0,%.0s' 1 2 3)$(printf '1,%.0s' $(seq 58) | sed 's/,$//')]"
MODEL_ARGS=(                            # read from config.json anyway; a flag that differs is refused
  --disable-bias-linear --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
  --kv-channels 128 --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu
  --untie-embeddings-and-output-weights --vocab-size 129280
  --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
  --v-head-dim 128 --qk-layernorm --rotary-scaling-factor 40 --rotary-base 10000 --mscale 1.0 --mscale-all-dim 1.0
  --attention-softmax-in-fp32 --no-rope-fusion
  --num-experts 256 --moe-layer-freq "$MOE_LAYER_FREQ" --moe-ffn-hidden-size 2048 --moe-router-topk 8
  --moe-shared-expert-intermediate-size 2048 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-group-topk 4 --moe-router-num-groups 8 --moe-router-topk-scaling-factor 2.5
)
MEGATRON_ARGS=(
  --tensor-model-parallel-size 8
  --pipeline-model-parallel-size 4
  --decoder-first-pipeline-num-layers 13 # 61 layers: 13 / 16 / 16 / 16
  --decoder-last-pipeline-num-layers 16
  --expert-model-parallel-size 32       # 256 experts, 8 on each of a stage's 32 ranks
  --expert-tensor-parallel-size 1
  --sequence-parallel
  --optimizer-cpu-offload
  --moe-token-dispatcher-type alltoall
  --moe-router-dtype fp32
  --moe-router-bias-update-rate 0       # the engines keep routing by the checkpoint's expert bias
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --no-use-cpu-initialization
)
SGLANG_ARGS=(
  --sglang-ep-size 16                   # experts split across each engine's 16 GPUs
  --sglang-mem-fraction-static 0.8
  --sglang-enable-memory-saver
)
ROUTER_ARGS=(
  --router-request-timeout-secs 3600
)

NUM_NODES=${NUM_NODES:-20} CONFIG=examples/configs/deepseek_v3.yaml exec "$HERE/multi_node.sh" \
  model.path="$MODEL_PATH" "${MODEL_ARGS[@]}" "${MEGATRON_ARGS[@]}" "${SGLANG_ARGS[@]}" "${ROUTER_ARGS[@]}" "$@"
