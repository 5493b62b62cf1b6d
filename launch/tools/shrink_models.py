"""The recipe's checkpoints swapped for tiny random models of their families, for launch.tools.shrink: the policy's
(its family read from config.json where the checkpoint is here, else from its name), a judge's and a reward model's.
`edit` is shrink's editor of the raw config (get / set / drop, each with the reason recorded)."""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

from glue.embedded_engine.tiny_model import tiny_config
from glue.plugins import load_object
from weight_sync.families import FAMILIES, MoeFamily, family_of

TEXT_VOCAB = 272  # a tiny model with a tokenizer: 256 bytes, 4 specials, 12 merges (examples/configs/text_arith.yaml)


def infer_family(model_path: str | None, name_hint: str) -> str:
    """The family of the recipe's checkpoint (weight_sync.families): its config.json's when the directory is here,
    else the first family whose name pattern matches the path or the recipe's name; qwen2 (the demos' family) when
    nothing matches."""
    if model_path and (Path(model_path) / "config.json").is_file():
        return family_of(json.loads((Path(model_path) / "config.json").read_text())).name
    text = f"{model_path or ''} {name_hint}".lower()
    return next((name for name, family in FAMILIES.items() if re.search(family.name_pattern, text)), "qwen2")


def shrink_model(edit: Any, name_hint: str) -> None:
    """The policy's checkpoint swapped for a tiny random model of its family (model.tiny), with what described the
    checkpoint (its shape flags, its pipeline split, the pass-through fields its config.json fixes) dropped."""
    if edit.get("model.shape"):
        edit.drop("model.shape", "the model-shape flags describe the recipe's checkpoint; the tiny stand-in has its "
                                 "own shape (they are checked against config.json where the checkpoint is)")
    path = edit.get("model.path")
    if path is None:
        return  # a tiny model already
    family = infer_family(path, name_hint)
    tokenizer = edit.get("run.mode") == "sft" or needs_tokenizer(edit.get("rollout.task", ""))
    tiny = {"family": family, "tokenizer": tokenizer, "num_layers": 2,
            "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}
    if tiny["tokenizer"]:
        tiny["vocab_size"] = TEXT_VOCAB
    if isinstance(FAMILIES[family], MoeFamily):  # experts in kind: two on each expert-parallel rank, top-2 routing
        ep = edit.get("trainer.expert_model_parallel_size", 1) or 1
        tiny.update(num_experts=2 * max(ep, 2), moe_top_k=2)
    edit.set("model.path", None, f"the checkpoint swapped for a tiny random {family} (model.tiny)")
    for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",  # the stage split
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        edit.drop(f"trainer.megatron.{key}", "sized for the recipe's layers; the tiny stand-in's 2 split evenly")
    edit.set("model.tiny", tiny, f"a tiny {family} of the recipe's family"
             + (" with a byte-level BPE tokenizer and ChatML template (the task tokenizes text)"
                if tiny["tokenizer"] else ""))
    _drop_checkpoint_fields(edit, family, tiny)


def _drop_checkpoint_fields(edit: Any, family: str, tiny: dict) -> None:
    """Pass-through fields that config.json fixes (the family's megatron_fields: slime's MLA and router flags) carry
    the recipe's checkpoint's values, checked against it where it is; the tiny stand-in has values of its own."""
    fixed = FAMILIES[family].megatron_fields(tiny_config(**{k: v for k, v in tiny.items() if k != "tokenizer"}))
    for key in sorted(set(edit.get("trainer.megatron") or {}) & set(fixed)):
        edit.drop(f"trainer.megatron.{key}", "a fact of the recipe's config.json (checked against it where the "
                                             "checkpoint is); the tiny stand-in has its own")


def shrink_reward_models(edit: Any) -> None:
    """A judge's or reward model's checkpoint is swapped for a tiny random text model of its family (both read
    text); the judge keeps one engine."""
    for section in ("judge", "reward_model"):
        path = edit.get(f"{section}.model.path")
        if path is None:
            continue
        family = infer_family(path, "")
        tiny = {"family": family, "tokenizer": True, "vocab_size": TEXT_VOCAB, "num_layers": 2, "hidden_size": 64,
                "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}
        edit.set(f"{section}.model.path", None, f"the {section} checkpoint swapped for a tiny random {family}")
        edit.set(f"{section}.model.tiny", tiny, f"a tiny {family} with a byte-level BPE tokenizer and ChatML template")
    if (edit.get("judge.num_engines") or 1) > 1:
        edit.set("judge.num_engines", 1, "one judge engine on CPU")


def needs_tokenizer(task_path: str) -> bool:
    """Whether the task class takes a tokenizer (a text task reads the policy's own)."""
    if not task_path:
        return False
    task = load_object(task_path, what="task")
    return inspect.isclass(task) and "tokenizer" in inspect.signature(task).parameters
