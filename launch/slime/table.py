"""slime's own launch arguments (slime/utils/arguments.py: names, defaults and meanings), each mapped to the sluice
config keys that mean the same, or refused in one line saying what to use instead. Rows whose values need the
whole run config (batch sizes, the GPU layout, the loss family) are `derived` and worked out in launch.slime.args."""
from __future__ import annotations

import os
from typing import Callable

from launch.slime.spec import SlimeArg, also, derived, no, same, switch, to

SLIME_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"  # slime's default --rollout-function-path
SLIME_FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
SLIME_DATA_SOURCE = "slime.rollout.data_source.RolloutDataSourceWithBuffer"  # slime's default --data-source-path
SLIME_NONZERO_STD = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
RM_HUB_REWARD = "rollout_fns.slime_rewards:rm_hub_reward"  # slime's rule-based rewards, as slime's rm_hub scores
RM_TYPES = ("deepscaler", "dapo", "math", "f1", "gpqa", "ifbench", "random")  # each also with a boxed_ prefix


def rollout_function(path: str, given: dict) -> dict:
    """slime's own rollout functions are modes of sluice's loop; any other is a user's, run through its adapter."""
    if path == SLIME_ROLLOUT:
        return {}
    if path == SLIME_FULLY_ASYNC:
        return {"run.mode": "async"}
    if path.startswith("slime."):
        raise ValueError(f"--rollout-function-path {path}: slime's own function has no sluice equivalent; sluice runs "
                         f"{SLIME_ROLLOUT} (the default) and {SLIME_FULLY_ASYNC} (run.mode: async)")
    return {"rollout.slime.rollout_function": path}


def max_context(value: int, given: dict) -> dict:
    """slime's --rollout-max-context-len: the functions' args.rollout_max_context_len, and the prompt limit slime
    derives from it (at least one response token) unless --rollout-max-prompt-len sets its own."""
    prompt_len = given.get("rollout_max_prompt_len")
    if prompt_len is not None and prompt_len > value - 1:
        raise ValueError(f"--rollout-max-prompt-len {prompt_len} must be at most --rollout-max-context-len {value} - 1 "
                         "(slime keeps room for one response token); lower it or raise the context length")
    return {"rollout.slime.max_context_len": value,
            **({"rollout.task_args.max_prompt_tokens": value - 1} if prompt_len is None else {})}


def reward_type(name: str, given: dict) -> dict:
    """--rm-type: the functions' args.rm_type as given, and the text task's reward (slime's rule of that name)
    unless --custom-rm-path (which slime calls instead) is set."""
    if given.get("custom_rm_path"):
        return {"rollout.slime.rm_type": name}
    if name.removeprefix("boxed_") not in RM_TYPES:
        raise ValueError(f"--rm-type {name}: no sluice equivalent (sluice has {', '.join(RM_TYPES)}, each also as "
                         "boxed_<name>); use --custom-rm-path, reward_model: for a served reward model, or "
                         "rollout.task_args.reward")
    return {"rollout.slime.rm_type": name, "rollout.task_args.reward": RM_HUB_REWARD,
            "rollout.task_args.reward_args": {"rm_type": name}}


def score_key(flag: str) -> Callable[[str, dict], dict]:
    """--reward-key / --eval-reward-key: sluice trains (and evaluates) the 'score' of a reward function's dict, so
    that key is accepted as it is and any other refused."""
    def check(key: str, given: dict) -> dict:
        if key != "score":
            raise ValueError(f"{flag} {key}: sluice trains the 'score' of a reward function's dict; return the value "
                             "to train under 'score' (or give --reward-key score)")
        return {}
    return check


def eval_data(values: list[str], given: dict) -> dict:
    """`--eval-prompt-data NAME PATH` (or a PATH alone, which slime names aime): one data set."""
    if len(values) > 2:
        raise ValueError(f"--eval-prompt-data {' '.join(values)}: sluice evaluates one data set; give one NAME PATH "
                         "pair (or set eval.task / eval.task_args)")
    return {"eval.task_args.path": values[-1]}


def run_folder(path: str, given: dict) -> dict:
    """`--save DIR`: DIR is the run folder (checkpoints in DIR/checkpoints); the same `--load` resumes from it."""
    path = os.path.normpath(path)
    return {"run.output_dir": os.path.dirname(path) or ".", "run.name": os.path.basename(path)}


def resume_from(path: str, given: dict) -> dict:
    if given.get("save") and os.path.normpath(given["save"]) == os.path.normpath(path):
        return {}  # run.resume: auto continues from the run folder's latest checkpoint, as slime does
    return {"run.resume": path}


def dynamic_filter(path: str, given: dict) -> dict:
    if path != SLIME_NONZERO_STD:
        raise ValueError(f"--dynamic-sampling-filter-path {path}: sluice's dynamic sampling keeps groups whose rewards "
                         f"differ ({SLIME_NONZERO_STD}); other filters have no equivalent")
    return {"rollout.dynamic_sampling": True}


def data_source(path: str, given: dict) -> dict:
    if path != SLIME_DATA_SOURCE:
        raise ValueError(f"--data-source-path {path}: no equivalent; a task class (rollout.task) gives the prompts")
    return {}


def weight_mode(mode: str, given: dict) -> dict:
    if mode != "full":
        raise ValueError(f"--update-weight-mode {mode}: no sluice equivalent; sync.delta: true sends changed elements "
                         "on broadcast to embedded engines")
    return {}


def weight_transport(name: str, given: dict) -> dict:
    if name not in ("nccl", "disk"):
        raise ValueError(f"--update-weight-transport {name}: choose nccl or disk")
    return {"sync.transport": "disk"} if name == "disk" else {}


def kl_estimator(name: str) -> str:
    return "k3" if name == "low_var_kl" else name


def loss_type(name: str, given: dict) -> dict:
    if name != "policy_loss":
        raise ValueError(f"--loss-type {name}: no equivalent in an RL run; use run.mode: sft (docs/sft.md) for sft_loss")
    return {}


def mode_switch(value: str, given: dict) -> dict:
    if value != "megatron":
        raise ValueError(f"--train-backend {value}: sluice trains with megatron-core only")
    return {}


CLUSTER = [
    derived("--actor-num-nodes", "cluster.num_nodes, cluster.trainer_gpus", "cluster", int,
            note="slime's default 1; with the GPUs per node gives the trainer's GPUs, and DP = those / (TP x PP x CP)"),
    derived("--actor-num-gpus-per-node", "cluster.gpus_per_node, cluster.trainer_gpus", "cluster", int,
            note="slime's default 8"),
    derived("--rollout-num-gpus", "cluster.engine_gpus, rollout.num_engines", "cluster", int,
            note="the engines' GPUs; with --colocate slime's default is the trainer's GPUs"),
    derived("--rollout-num-gpus-per-engine", "cluster.engine_tensor_parallel_size, rollout.num_engines", "cluster", int,
            note="SGLang TP of each engine; engines = rollout GPUs / this"),
    derived("--num-gpus-per-node", "cluster.gpus_per_node", "cluster", int,
            note="slime's default 8: GPUs of each node, nodes = all GPUs / this"),
    derived("--colocate", "cluster.placement: colocated", "cluster", takes="none",
            note="trainer and engines share the GPUs (offloaded around each phase, weights by CUDA IPC)"),
    same("--offload", "cluster", "colocated placement always offloads each side around the other's phase"),
    same("--offload-train", "cluster", "colocated placement offloads the trainer during rollout", takes="negatable"),
    same("--offload-rollout", "cluster", "colocated placement releases engine memory during training",
         takes="negatable"),
    same("--distributed-backend", "cluster", "the trainer uses nccl on GPUs and gloo on CPU"),
    no("--distributed-timeout-minutes", "cluster", "sync.timeout_s bounds a weight sync", scalar=int),
    SlimeArg("--train-backend", "cluster", "-", "one", str, mode_switch, "megatron only"),
]

TRAIN = [
    no("--qwen-gdn-backend", "train", "the trainer builds the families of docs/models.md (no linear attention)"),
    no("--train-env-vars", "train", "export the variables before sluice starts; Ray passes them to the trainer"),
    SlimeArg("--update-weight-mode", "train", "-", "one", str, weight_mode,
             "full (slime's default, sluice's too); delta has no equivalent: sync.delta: true sends changed elements "
             "on broadcast to embedded engines"),
    SlimeArg("--update-weight-transport", "train", "sync.transport", "one", str, weight_transport,
             "nccl (slime's default): sluice's default (broadcast, or CUDA IPC when colocated); disk -> disk"),
    no("--release-train", "train", "the trainer stays resident (colocated placement offloads it)", takes="none"),
    to("--update-weight-disk-dir", "sync.disk_dir", "train"),
    no("--update-weight-disk-keep-files", "train", "the disk transport keeps no old checkpoints", takes="none"),
    no("--update-weight-delta-encoding", "train", "sync.delta: true"),
    no("--update-weight-delta-checksum", "train", "sync.verify: checksum"),
    no("--custom-update-weight-post-write-path", "train", "the disk transport needs a shared POSIX file system"),
    no("--update-weight-local-checkpoint-dir", "train", "sync.disk_dir"),
    no("--custom-model-provider-path", "train", "the trainer builds the model from config.json"),
    same("--recompute-loss-function", "train", "the loss is computed per micro-batch"),
    same("--log-probs-chunk-size", "train", "logprobs never copy the whole logits to fp32", takes="one", scalar=int),
    no("--only-train-params-name-list", "train", "every parameter is trained", takes="many"),
    no("--freeze-params-name-list", "train", "every parameter is trained", takes="many"),
    no("--freeze-indexer", "train", "every parameter is trained", takes="none"),
    no("--allgather-cp", "train", "context parallelism is not run by this trainer", takes="none"),
]

ROLLOUT = [
    to("--hf-checkpoint", "model.path", "rollout", note="the HF checkpoint: engines, tokenizer and the trainer's "
                                                         "initial weights"),
    same("--model-name", "rollout", "the family is config.json's model_type"),
    SlimeArg("--rollout-function-path", "rollout", "run.mode / rollout.slime.rollout_function", "one", str,
             rollout_function, f"{SLIME_ROLLOUT}: sluice's loop; {SLIME_FULLY_ASYNC}: run.mode async; your own "
                               "function: rollout.slime.rollout_function"),
    also("--rollout-temperature", {"rollout.sampling.temperature": float, "trainer.temperature": float}, "rollout",
         float, note="slime's default 1.0; the trainer divides logits by it too"),
    to("--rollout-top-p", "rollout.sampling.top_p", "rollout", float),
    to("--rollout-top-k", "rollout.sampling.top_k", "rollout", int),
    SlimeArg("--rollout-max-context-len", "rollout", "rollout.slime.max_context_len", "one", int, max_context,
             "args.rollout_max_context_len for slime functions; with no --rollout-max-prompt-len, prompts longer "
             "than it - 1 are passed over, as in slime"),
    to("--rollout-max-prompt-len", "rollout.task_args.max_prompt_tokens", "rollout", int,
       note="longer prompts are passed over, as slime filters them"),
    to("--rollout-max-response-len", "rollout.sampling.max_new_tokens", "rollout", int),
    no("--rollout-skip-special-tokens", "rollout", "the text task decodes responses for its reward itself",
       takes="none"),
    to("--rollout-stop", "rollout.sampling.stop", "rollout", takes="many",
       note="stop strings in every sampling_params (the engines need the model's tokenizer) and args.rollout_stop"),
    to("--rollout-stop-token-ids", "rollout.sampling.stop_token_ids", "rollout", int, takes="many"),
    switch("--rollout-shuffle", {"rollout.task_args.shuffle": True}, "rollout",
           note="slime's default (and so sluice's with --prompt-data): not shuffled"),
    to("--rollout-seed", "run.seed", "rollout", int, note="slime's default 42, sluice's 0"),
    to("--over-sampling-batch-size", "rollout.slime.over_sampling_batch_size", "rollout", int,
       note="args.over_sampling_batch_size for the functions (slime's default: --rollout-batch-size); sluice's own loop "
            "starts a step's prompts at once and, with rollout.dynamic_sampling, replaces a dropped group's prompt one "
            "at a time"),
    SlimeArg("--dynamic-sampling-filter-path", "rollout", "rollout.dynamic_sampling: true", "one", str, dynamic_filter,
             f"{SLIME_NONZERO_STD} only"),
    switch("--partial-rollout", {"sync.partial_rollouts": "resume"}, "rollout",
           note="an aborted sample resumes from its tokens so far (sluice's default)"),
    no("--mask-offpolicy-in-partial-rollout", "rollout", "every token carries its own policy version; "
                                                         "sync.partial_rollouts: restart never mixes versions",
       takes="none"),
    to("--custom-generate-function-path", "rollout.slime.generate_function", "rollout",
       note="slime's generate(args, sample, sampling_params), run through sluice's adapter"),
    no("--rollout-sample-hook-path", "rollout", "a rollout function (rollout.function) sees every sample"),
    no("--custom-rollout-log-function-path", "rollout", "metrics.jsonl, TensorBoard and W&B get every rollout metric"),
    no("--custom-eval-rollout-log-function-path", "rollout", "eval/* metrics are logged for every evaluation"),
    no("--buffer-filter-path", "rollout", "rollout.buffer_order picks which finished groups a step takes"),
    to("--update-weight-buffer-size", "sync.bucket_bytes", "rollout", int, note="bytes, both sides"),
    to("--update-weights-interval", "sync.interval", "rollout", int),
    no("--keep-old-actor", "rollout", "trainer.old_logprobs: snapshot keeps the last versions' weights",
       takes="none"),
    no("--rollout-data-postprocess-path", "rollout", "a rollout function sets each sample's loss mask"),
    no("--rollout-data-transport", "rollout", "the driver sends each DP group only its share"),
    no("--rollout-external-engine-addrs", "rollout", "sluice starts and watches its own engines", takes="many"),
    same("--use-fault-tolerance", "rollout", "engines are always health-checked and restarted "
                                             "(rollout.max_engine_restarts)"),
    to("--rollout-health-check-interval", "rollout.health_check_interval_s", "rollout", float),
    to("--rollout-health-check-timeout", "rollout.health_check_timeout_s", "rollout", float),
    no("--rollout-health-check-first-wait", "rollout", "checks start once an engine is healthy "
                                                       "(rollout.engine_startup_timeout_s)", scalar=float),
]

DATA = [
    to("--num-rollout", "run.num_steps", "data", int),
    no("--num-epoch", "data", "run.num_steps (--num-rollout): epochs x rows / --rollout-batch-size", scalar=int),
    no("--disable-rollout-global-dataset", "data", "a task (rollout.task) gives the prompts", takes="none"),
    SlimeArg("--data-source-path", "data", "-", "one", str, data_source,
             f"{SLIME_DATA_SOURCE} only (a task class gives the prompts)"),
    also("--prompt-data", {"rollout.task": lambda v: "rollout_fns.text_data:TextDataTask", "rollout.task_args.path": str},
         "data", note="JSONL / Parquet rows; with slime's defaults: --input-key input, no chat template, not "
                      "shuffled; --label-key is needed"),
    switch("--apply-chat-template", {"rollout.task_args.apply_chat_template": True}, "data",
           note="slime's default (and sluice's with --prompt-data): plain text"),
    no("--apply-chat-template-kwargs", "data", "the checkpoint's chat template as it is"),
    to("--input-key", "rollout.task_args.prompt_key", "data", note="slime's default 'input'"),
    to("--label-key", "rollout.task_args.label_key", "data", note="slime has no default, sluice's is 'answer'"),
    no("--multimodal-keys", "data", "text tasks only"),
    no("--metadata-key", "data", "the row's index and epoch are in sample.metadata"),
    no("--tool-key", "data", "a multi-turn task gives its tools (docs/rollout_functions.md)"),
    no("--start-rollout-id", "data", "run.resume continues a run where its checkpoint stopped", scalar=int),
    to("--rollout-batch-size", "rollout.prompts_per_step", "data", int),
    to("--n-samples-per-prompt", "rollout.samples_per_prompt", "data", int),
    derived("--global-batch-size", "trainer.num_mini_batches", "data", int,
            note="= rollout-batch-size x n-samples-per-prompt / global-batch-size optimizer steps per rollout"),
    to("--num-steps-per-rollout", "trainer.num_mini_batches", "data", int),
    switch("--balance-data", {"trainer.dp_balance": "tokens"}, "data",
           note="each DP rank gets near-equal trained tokens"),
    no("--balance-by-flops", "data", "trainer.dp_balance: tokens", takes="none"),
    derived("--use-dynamic-batch-size", "trainer.max_tokens_per_micro_batch", "data", takes="none",
            note="with --max-tokens-per-gpu: packed micro-batches of at most that many tokens"),
    derived("--max-tokens-per-gpu", "trainer.max_tokens_per_micro_batch", "data", int,
            note="read with --use-dynamic-batch-size, as in slime"),
    same("--log-probs-max-tokens-per-gpu", "data", "logprob passes pack as the training passes do", takes="one",
         scalar=int),
]

EVAL = [
    no("--eval-function-path", "eval", "eval.task (a task class) with the rollout function"),
    to("--eval-interval", "eval.interval", "eval", int),
    SlimeArg("--eval-prompt-data", "eval", "eval.task_args.path", "many", str, eval_data,
             "NAME PATH: the training task on PATH; eval temperature, top-p, top-k and length follow the rollout's "
             "unless given (slime's defaults; sluice's eval temperature alone is 0)"),
    no("--eval-config", "eval", "eval.task / eval.task_args"),
    switch("--skip-eval-before-train", {"eval.at_start": False}, "eval"),
    to("--eval-input-key", "eval.task_args.prompt_key", "eval"),
    to("--eval-label-key", "eval.task_args.label_key", "eval"),
    no("--eval-tool-key", "eval", "a multi-turn task gives its tools"),
    to("--n-samples-per-eval-prompt", "eval.samples_per_prompt", "eval", int),
    to("--eval-temperature", "eval.sampling.temperature", "eval", float, note="slime's default: the rollout's"),
    to("--eval-top-p", "eval.sampling.top_p", "eval", float),
    to("--eval-top-k", "eval.sampling.top_k", "eval", int),
    to("--eval-max-response-len", "eval.sampling.max_new_tokens", "eval", int),
    to("--eval-max-prompt-len", "eval.task_args.max_prompt_tokens", "eval", int),
    no("--eval-min-new-tokens", "eval", "eval.sampling.max_new_tokens bounds the length", scalar=int),
    to("--eval-max-context-len", "rollout.slime.eval_max_context_len", "eval", int,
       note="args.eval_max_context_len for slime functions; slime's default: --rollout-max-context-len"),
]
