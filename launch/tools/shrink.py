"""A shipped recipe shrunk to what 2 CPU cores hold, for `make rehearse` (launch.tools.rehearse): the same run in kind
(mode, placement, parallel dimensions > 1, routing replay, dynamic sampling, checkpoints, loss) at toy size, with a
record of every value scaled, dropped or added and why. Works on the raw config mapping (YAML + pass-through flags +
overrides, as `launch.config.load_config` merges them); imports no backend.
"""
from __future__ import annotations

import copy
import inspect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glue.embedded_engine.__main__ import parse_args
from glue.plugins import load_object
from launch.args.options import to_argv
from launch.args.sglang import sglang_options
from rollout_fns.arith_data import arith_rows
from launch.tools.shrink_models import infer_family, shrink_model, shrink_reward_models  # noqa: F401 (API)

STEPS = 2  # train steps of a rehearsal: the first one starts everything, the second one follows a weight sync
MAX_TRAINER_RANKS = 2  # trainer world size on 2 cores (each rank is a process with its own model copy)
MAX_PARALLEL = 2  # any one parallel dimension (TP, PP, EP, ETP, DP, engine TP / EP)
PROMPTS, SAMPLES, NEW_TOKENS, EVAL_PROMPTS = 4, 4, 8, 4
SFT_ROWS = 64  # generated chats an SFT recipe's rehearsal trains on


# megatron-core fields whose recipe values need CUDA; the CPU trainer keeps its own (glue/trainer/model.py).
GPU_ONLY_MEGATRON = {
    "use_cpu_initialization": "the recipe initialises on the GPU; the CPU trainer initialises on the host",
    "gradient_accumulation_fusion": "fused weight-gradient accumulation is a CUDA kernel",
    "moe_permute_fusion": "Transformer-Engine's fused token permute is a CUDA kernel",
    "moe_grouped_gemm": "the rehearsal runs the experts as SequentialMLP (the same parameters and results; sluice's "
                        "grouped experts run on CPU too, checked by tests/test_grouped_experts.py)",
    "moe_token_dispatcher_type": "the all-to-all dispatcher needs CUDA streams; on CPU the trainer dispatches by "
                                 "allgather",
    "bf16": "the CPU trainer and embedded engines compute in float32",
    "fp16": "the CPU trainer and embedded engines compute in float32",
    "params_dtype": "the CPU trainer and embedded engines compute in float32",
    "masked_softmax_fusion": "a CUDA kernel", "bias_activation_fusion": "a CUDA kernel",
    "bias_dropout_fusion": "a CUDA kernel", "apply_rope_fusion": "a CUDA kernel", "persist_layer_norm": "a CUDA kernel",
}
SGLANG_PARALLEL = ("ep_size", "expert_parallel_size", "dp_size", "data_parallel_size", "pp_size")


@dataclass
class ShrinkRecord:
    """What the shrink did to a recipe: `scaled` {key: {from, to, why}}, `dropped` (not rehearsed) {key: {value,
    why}}, `added` {key: {to, why}}, `kept` {key: value} (every other setting of the recipe, unchanged)."""

    engine: str
    scaled: dict[str, dict] = field(default_factory=dict)
    dropped: dict[str, dict] = field(default_factory=dict)
    added: dict[str, dict] = field(default_factory=dict)
    kept: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "scaled": self.scaled, "dropped": self.dropped, "added": self.added,
                "kept": self.kept, "notes": self.notes}


@dataclass
class Shrunk:
    raw: dict[str, Any]  # the shrunk config mapping, ready for yaml.safe_dump and `sluice --config`
    record: ShrinkRecord
    data_files: dict[str, tuple[str, str]] = field(default_factory=dict)  # stand-in data: path -> (prompt, label key)


class _Editor:
    """Dotted-key edits of a nested mapping, each one written into the record."""

    def __init__(self, raw: dict[str, Any], record: ShrinkRecord):
        self.raw, self.record = raw, record

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.raw
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def _put(self, key: str, value: Any) -> None:
        *parents, leaf = key.split(".")
        node = self.raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def set(self, key: str, value: Any, why: str) -> None:
        """Scale `key` to `value` (or add it when the recipe does not set it); a no-op when it already holds it."""
        missing = object()
        old = self.get(key, missing)
        if old is not missing and old == value:
            return
        self._put(key, value)
        if old is missing:
            self.record.added[key] = {"to": value, "why": why}
        else:
            self.record.scaled[key] = {"from": old, "to": value, "why": why}

    def drop(self, key: str, why: str) -> None:
        *parents, leaf = key.split(".")
        parent = self.get(".".join(parents)) if parents else self.raw
        if isinstance(parent, dict) and leaf in parent:
            value = parent.pop(leaf)
            scaled = self.record.scaled.pop(key, None)  # dropped after scaling: the recipe's own value is recorded
            self.record.dropped[key] = {"value": scaled["from"] if scaled else value, "why": why}


def shrink(raw: dict[str, Any], *, data_dir: str | Path, engine: str = "sglang_strict", steps: int = STEPS,
           name_hint: str = "") -> Shrunk:
    """`raw` (a recipe's merged config mapping) shrunk for a CPU rehearsal of `steps` steps on `engine`
    ("sglang_strict", or "embedded": the lenient engine, sluice's own semantics), data files under `data_dir`.
    `name_hint` (the recipe's file name) helps name the checkpoint family when model.path is not on this machine.
    Writes nothing: it reads model.path/config.json when it exists, imports the task class (does it take a tokenizer,
    does it write its own data) and asks the embedded engine's parser; the stand-in data is written by `write_data`."""
    if engine not in ("sglang_strict", "embedded"):
        raise ValueError(f"shrink: engine must be 'sglang_strict' or 'embedded', got {engine!r}")
    original = copy.deepcopy(raw)
    record = ShrinkRecord(engine=engine)
    edit = _Editor(copy.deepcopy(raw), record)
    shrunk = Shrunk(raw=edit.raw, record=record)
    _shrink_run(edit, steps)
    _shrink_cluster(edit, engine)
    _shrink_trainer(edit)
    shrink_model(edit, name_hint)
    shrink_reward_models(edit)
    _shrink_data(edit, shrunk, Path(data_dir))
    _shrink_sft(edit, Path(data_dir))
    _shrink_rollout(edit, steps)
    _shrink_sync(edit, steps)
    _shrink_sglang(edit)
    _shrink_teacher(edit)
    record.kept = {key: value for key, value in _leaves(original).items()
                   if not any(key == k or key.startswith(k + ".") for k in (*record.scaled, *record.dropped))}
    return shrunk


def _shrink_run(edit: _Editor, steps: int) -> None:
    edit.set("run.num_steps", steps, "a rehearsal trains this many steps")
    if edit.get("run.ray_address") is not None:
        edit.set("run.ray_address", None, "one machine: sluice starts its own local Ray")


def _shrink_cluster(edit: _Editor, engine: str) -> None:
    per_node, tp = edit.get("cluster.gpus_per_node", 0) or 0, edit.get("cluster.engine_tensor_parallel_size") or 1
    nodes = edit.get("cluster.engine_nodes") or (tp // per_node if 0 < per_node < tp else 1)  # an engine's nodes
    if edit.get("cluster.num_nodes", 1) > 1:
        edit.set("cluster.num_nodes", 1, "rehearsed on one node (one local Ray); the multi-node placement is not")
    if edit.get("cluster.gpus_per_node", 0):
        edit.set("cluster.gpus_per_node", 0, "CPU bundles")
    for key in ("cluster.trainer_gpus", "cluster.engine_gpus", "teacher.gpus", "judge.gpus"):
        if edit.get(key) is not None:
            edit.set(key, None, "follows the shrunk layout")
    edit.drop("cluster.node_ip", "one node: the loopback address")
    edit.set("cluster.engine", engine, "SGLang semantics on CPU" if engine == "sglang_strict" else
             "the lenient embedded engine (sluice's own semantics)")
    for key in ("cluster.engine_tensor_parallel_size", "teacher.tensor_parallel_size", "judge.tensor_parallel_size"):
        if (edit.get(key) or 1) > 1:
            to = MAX_PARALLEL if engine == "sglang_strict" else 1
            edit.set(key, to, "engine TP kept > 1, simulated by the strict engine"
                     if to > 1 else "the embedded engine runs one process per engine; 2 under sglang_strict")
    if nodes > 1 and engine == "sglang_strict":
        edit.set("cluster.engine_nodes", MAX_PARALLEL, f"an engine over {nodes} nodes: {MAX_PARALLEL} node-rank "
                 "processes of a strict engine, one TP rank each")
    elif edit.get("cluster.engine_nodes") is not None:
        edit.drop("cluster.engine_nodes", "the lenient embedded engine runs one process per engine")


def _shrink_trainer(edit: _Editor) -> None:
    """Each parallel dimension to at most MAX_PARALLEL, then DP, PP, TP lowered (in that order) until the trainer has
    at most MAX_TRAINER_RANKS ranks; EP then the largest divisor of TP x DP / ETP it can keep."""
    sizes = {name: edit.get(f"trainer.{name}_size", 1) or 1 for name in
             ("tensor_model_parallel", "pipeline_model_parallel", "context_parallel", "data_parallel",
              "expert_model_parallel")}
    new = {name: min(size, MAX_PARALLEL) for name, size in sizes.items()}
    for name in ("data_parallel", "pipeline_model_parallel", "tensor_model_parallel"):
        while new[name] > 1 and math.prod(new[n] for n in ("tensor_model_parallel", "pipeline_model_parallel",
                                                              "context_parallel", "data_parallel")) > MAX_TRAINER_RANKS:
            new[name] //= 2
    etp = edit.get("trainer.expert_tensor_parallel_size")
    if etp is not None:
        etp = min(etp, new["tensor_model_parallel"])
        edit.set("trainer.expert_tensor_parallel_size", etp, "at most TP")
    dense = new["tensor_model_parallel"] * new["context_parallel"] * new["data_parallel"]
    expert_room = dense // (etp or new["tensor_model_parallel"])
    new["expert_model_parallel"] = math.gcd(new["expert_model_parallel"], expert_room)
    for name, size in new.items():
        if size != sizes[name]:
            edit.set(f"trainer.{name}_size", size, f"at most {MAX_PARALLEL} per dimension and {MAX_TRAINER_RANKS} "
                     "trainer ranks on 2 cores")
    megatron = edit.get("trainer.megatron") or {}
    for key, why in GPU_ONLY_MEGATRON.items():
        value = megatron.get(key)
        if key in megatron and not (key == "moe_token_dispatcher_type" and value == "allgather"):
            edit.drop(f"trainer.megatron.{key}", f"GPU only: {why}")
    if megatron.get("sequence_parallel") and new["tensor_model_parallel"] == 1:
        edit.drop("trainer.megatron.sequence_parallel", "needs TP > 1, and TP is 1 here")


def _shrink_data(edit: _Editor, shrunk: Shrunk, data_dir: Path) -> None:
    """Data files move under data_dir: a task that writes its own (it takes num_rows) writes it there; for any other
    a stand-in file of arithmetic questions under the recipe's prompt and label keys is written (write_data)."""
    task_path = edit.get("rollout.task", "")
    writes_own = False
    if task_path:
        task = load_object(task_path, what="task")
        writes_own = inspect.isclass(task) and "num_rows" in inspect.signature(task).parameters
    train_args = edit.get("rollout.task_args") or {}
    for section in ("rollout", "eval"):
        args = edit.get(f"{section}.task_args") or {}
        if "path" not in args:
            continue
        target = str(data_dir / f"{section}-{Path(args['path']).name}")
        edit.set(f"{section}.task_args.path", target, "the task writes its data here" if writes_own else
                 "a stand-in data file of arithmetic questions (the recipe's data is not on this machine)")
        if not writes_own:
            merged = {**train_args, **args}
            shrunk.data_files[target] = (merged.get("prompt_key", "prompt"), merged.get("label_key", "answer"))


def _shrink_sft(edit: _Editor, data_dir: Path) -> None:
    """An SFT recipe's chat data moves under data_dir, as generated arithmetic chats (glue.sft.data) written by the
    run itself: the recipe's own file is not on this machine, or is far more than two steps read."""
    if edit.get("run.mode") != "sft":
        return
    if edit.get("sft.data") is not None:
        edit.set("sft.data", str(data_dir / f"sft-{Path(edit.get('sft.data')).stem}.jsonl"),
                 "generated arithmetic chats, written here by the run (sft.example_rows)")
    if edit.get("sft.example_rows", 0) != SFT_ROWS:
        edit.set("sft.example_rows", SFT_ROWS, "a small stand-in chat data set")
    if edit.get("sft.conversations_per_step", 16) > PROMPTS * SAMPLES:
        edit.set("sft.conversations_per_step", PROMPTS * SAMPLES, "small batch")


def _shrink_rollout(edit: _Editor, steps: int) -> None:
    for key, limit in (("rollout.num_engines", MAX_PARALLEL), ("rollout.prompts_per_step", PROMPTS),
                       ("rollout.samples_per_prompt", SAMPLES), ("rollout.sampling.max_new_tokens", NEW_TOKENS),
                       ("eval.num_prompts", EVAL_PROMPTS)):
        value = edit.get(key)
        if value is not None and value > limit:
            edit.set(key, limit, "small batch")
    interval = edit.get("eval.interval")
    if interval and interval > steps:
        edit.set("eval.interval", steps, "the held-out evaluation runs once within the rehearsal")
    if edit.get("rollout.dynamic_sampling"):
        # A random tiny policy scores the same on every answer, so every group would be dropped: a length penalty
        # on the recipe's own reward makes the groups differ and keeps dynamic sampling's filter in the run.
        reward_args = edit.get("rollout.task_args.reward_args")
        if edit.get("rollout.task_args.reward") and not (reward_args or {}).get("length_penalty"):
            # about one character per token from a tiny byte-level tokenizer: some answers over, some under
            edit.set("rollout.task_args.reward_args.max_response_chars", NEW_TOKENS,
                     "with length_penalty: a random tiny policy's groups get unequal rewards, so dynamic sampling "
                     "keeps about 70% of them")
            edit.set("rollout.task_args.reward_args.length_penalty", 0.5, "see max_response_chars")


def _shrink_sync(edit: _Editor, steps: int) -> None:
    """The sync cadence fits `steps` (at least one sync happens), keeping the slack max_staleness - interval + 1."""
    if edit.get("sync.backend") == "nccl":
        edit.set("sync.backend", "gloo", "GPU only: nccl; the weight group runs on gloo on CPU")
    interval = edit.get("sync.interval", 1)
    if interval > steps:
        slack = (edit.get("sync.max_staleness") if edit.get("sync.max_staleness") is not None else 1) - interval + 1
        edit.set("sync.interval", steps, "a weight sync happens within the rehearsal")
        if edit.get("sync.max_staleness") is not None:
            edit.set("sync.max_staleness", max(steps - 1 + slack, 0), "keeps the recipe's max_staleness - interval")


def _shrink_teacher(edit: _Editor) -> None:
    """A distillation recipe's teacher (`teacher:`): its checkpoint swapped for a random model of the tiny policy's
    shape and vocabulary (`stand_in_teacher`, built at start-up), its fleet to at most MAX_PARALLEL engines."""
    if edit.get("teacher") is None:
        return
    if edit.get("teacher.path") is not None:
        edit.drop("teacher.path", "the teacher's checkpoint is not rehearsed: a random model of the tiny policy's "
                                  "shape stands in (teacher.build)")
        edit.set("teacher.build", "launch.tools.shrink:stand_in_teacher", "stands in for teacher.path")
    engines = edit.get("teacher.num_engines")
    if engines is not None and engines > MAX_PARALLEL:
        edit.set("teacher.num_engines", MAX_PARALLEL, "small fleet")


def stand_in_teacher(out_dir: str, policy_dir: str) -> None:
    """`teacher.build` of a shrunk distillation recipe: a random model with the policy's config (so its vocabulary)
    and other weights than the policy's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(policy_dir)).to(torch.float32).save_pretrained(out_dir)


def _shrink_sglang(edit: _Editor) -> None:
    """Engine parallel sizes to at most the engine TP; then every SGLang option the embedded engine does not
    implement is dropped (not rehearsed): its own argument parser decides, so the list follows the engine."""
    sglang = edit.get("sglang") or {}
    engine_tp = edit.get("cluster.engine_tensor_parallel_size", 1)
    for key in SGLANG_PARALLEL:
        if key in sglang and isinstance(sglang[key], int) and sglang[key] > engine_tp:
            edit.set(f"sglang.{key}", engine_tp, "at most the engine TP")
    strict = edit.get("cluster.engine") == "sglang_strict"
    for key in list(sglang):
        reason = embedded_engine_refuses(key, sglang[key], strict=strict)
        if reason:
            edit.drop(f"sglang.{key}", f"not implemented by the embedded engine ({reason})")


def embedded_engine_refuses(key: str, value: Any, *, strict: bool) -> str | None:
    """Why the embedded engine's argument parser refuses `--<key> value` (None when it takes it)."""
    import contextlib
    import io

    argv = ["--model-path", "unused", *(["--sglang-strict"] if strict else []),
            *to_argv({key: value}, sglang_options())]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(argv)
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        return lines[-1] if lines else "refused"
    return None


def _leaves(raw: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(raw, dict) or not raw:
        return {prefix.rstrip("."): raw} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        out.update(_leaves(value, f"{prefix}{key}."))
    return out


def write_data(shrunk: Shrunk, rows: int = 64) -> None:
    """The stand-in data files: `rows` arithmetic questions (operands 0..2, as examples/configs/text_arith.yaml) under
    each file's prompt and label keys."""
    for path, (prompt_key, label_key) in shrunk.data_files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for row in arith_rows(rows, 0, low=0, high=2, operators="+"):
                f.write(json.dumps({prompt_key: row["prompt"], label_key: row["answer"]}) + "\n")
