"""The argument lists of slime's public Qwen3 scripts, as data (THUDM/slime: scripts/run-qwen3-4B.sh,
scripts/run-qwen3-30B-A3B.sh, examples/strands_sglang/strands_qwen3_8b.sh, examples/fully_async/
run-qwen2.5-0.5B-fully_async.sh, with the MODEL_ARGS of scripts/models/*.sh they source), group by group as the
scripts write them, with their paths replaced by {model}, {data}, {eval_data} and {save}; and the config.json
shape numbers of the checkpoints they name, so a directory holding config.json alone stands in for each."""

MOE_LAYER_FREQ_48 = "[" + ",".join(["1"] * 48) + "]"  # scripts/models/qwen3-30B-A3B.sh's printf, FIRST_K_DENSE 0

QWEN3_4B_MODEL = [
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--rotary-base", "1000000", "--vocab-size", "151936", "--kv-channels", "128", "--qk-layernorm",
]
QWEN3_8B_MODEL = [
    "--swiglu", "--num-layers", "36", "--hidden-size", "4096", "--ffn-hidden-size", "12288",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--rotary-base", "1000000", "--vocab-size", "151936", "--kv-channels", "128", "--qk-layernorm",
    "--untie-embeddings-and-output-weights",
]
QWEN3_30B_A3B_MODEL = [
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "32",
    "--num-query-groups", "4", "--kv-channels", "128", "--num-layers", "48", "--hidden-size", "2048",
    "--ffn-hidden-size", "6144", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "1.0", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "151936", "--rotary-base", "1000000",
    "--moe-ffn-hidden-size", "768", "--moe-router-score-function", "softmax", "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-topk", "8", "--moe-layer-freq", MOE_LAYER_FREQ_48, "--num-experts", "128", "--moe-grouped-gemm",
    "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion", "--moe-aux-loss-coeff",
    "0",
]
QWEN25_05B_MODEL = [
    "--swiglu", "--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864", "--num-attention-heads", "14",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--group-query-attention", "--num-query-groups", "2",
    "--vocab-size", "151936",
]

DAPO_ROLLOUT = [
    "--prompt-data", "{data}", "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
    "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3000", "--rollout-batch-size", "32",
    "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8192", "--rollout-temperature", "1",
    "--global-batch-size", "256", "--balance-data",
]
AIME_EVAL = [
    "--eval-interval", "20", "--eval-prompt-data", "aime", "{eval_data}", "--n-samples-per-eval-prompt", "16",
    "--eval-max-response-len", "16384", "--eval-top-p", "1",
]
GRPO = [
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
]
OPTIMIZER = ["--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
             "--adam-beta1", "0.9", "--adam-beta2", "0.98"]
MISC = ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
        "--attention-softmax-in-fp32", "--attention-backend", "flash"]


def perf(tp: str, ep: str, max_tokens: str, recompute: bool = True) -> list[str]:
    return ["--tensor-model-parallel-size", tp, "--sequence-parallel", "--pipeline-model-parallel-size", "1",
            "--context-parallel-size", "1", "--expert-model-parallel-size", ep, "--expert-tensor-parallel-size", "1",
            *(["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
              if recompute else []),
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", max_tokens]


SCRIPTS = {
    "run-qwen3-4B.sh": [
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate", *QWEN3_4B_MODEL,
        "--hf-checkpoint", "{model}", "--ref-load", "{model}", "--load", "{save}", "--save", "{save}",
        "--save-interval", "20", *DAPO_ROLLOUT, *OPTIMIZER, *GRPO, *perf("2", "1", "9216"), *AIME_EVAL,
        "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7", *MISC,
    ],
    "run-qwen3-30B-A3B.sh": [
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate", *QWEN3_30B_A3B_MODEL,
        "--hf-checkpoint", "{model}", "--ref-load", "{model}", "--load", "{save}", "--save", "{save}",
        "--save-interval", "20", *DAPO_ROLLOUT, *OPTIMIZER, "--optimizer-cpu-offload",
        "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer", *GRPO, *perf("4", "8", "20480"),
        *AIME_EVAL, "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.7",
        # slime pins an older SGLang: the installed one renamed --cuda-graph-bs to --cuda-graph-bs-decode
        "--sglang-cuda-graph-bs-decode", "1", "2", "4", "8", *[str(n) for n in range(16, 257, 8)], *MISC,
    ],
    "strands_qwen3_8b.sh": [
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate", *QWEN3_8B_MODEL,
        "--hf-checkpoint", "{model}", "--ref-load", "{model}", "--save", "{save}", "--save-interval", "20",
        "--rotary-base", "1000000",
        "--prompt-data", "{data}", "--input-key", "prompt", "--label-key", "label", "--rollout-shuffle",
        "--num-rollout", "3000", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "16384", "--rollout-temperature", "1", "--global-batch-size", "128",
        "--balance-data", *OPTIMIZER, *GRPO,
        "--use-wandb", "--wandb-project", "strands-slime", "--wandb-group", "Qwen3-8B-strands-dapo",
        "--wandb-key", "test-key", *perf("2", "1", "18432"), *AIME_EVAL,
        "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.4", *MISC,
        # slime's examples.strands_sglang.generate_with_strands module, replaced by a local file of the same functions
        "--custom-generate-function-path", "{user_module}:generate",
        "--custom-rm-path", "{user_module}:reward_func",
    ],
    "run-qwen2.5-0.5B-fully_async.sh": [
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "3", *QWEN25_05B_MODEL,
        "--hf-checkpoint", "{model}", "--ref-load", "{model}", "--save", "{save}", "--save-interval", "9999",
        "--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
        "--prompt-data", "{data}", "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3", "--rollout-batch-size", "8",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "1024", "--rollout-temperature", "1",
        "--global-batch-size", "32", "--balance-data", *perf("1", "1", "4096", recompute=False), *GRPO, *OPTIMIZER,
        "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.55", *MISC,
    ],
}

_QWEN = {"vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
         "torch_dtype": "bfloat16", "attention_bias": False}
CONFIGS = {  # config.json shape numbers of the checkpoints the scripts name
    "run-qwen3-4B.sh": {**_QWEN, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
                        "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
                        "max_position_embeddings": 40960},
    "run-qwen3-30B-A3B.sh": {**_QWEN, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                             "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                             "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                             "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                             "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
                             "max_position_embeddings": 40960},
    "strands_qwen3_8b.sh": {**_QWEN, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                            "tie_word_embeddings": False, "max_position_embeddings": 40960},
    "run-qwen2.5-0.5B-fully_async.sh": {**_QWEN, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                                        "num_attention_heads": 14, "num_key_value_heads": 2,
                                        "tie_word_embeddings": True, "max_position_embeddings": 32768},
}
