"""The frozen reference policy of the KL loss term: the initial policy (`model.path`) by default, or the weights of
`trainer.ref_load` (slime's `--ref-load`), which may be an HF directory or one of sluice's own checkpoints.

`resolve_ref_load` says which a directory is, with one line for a missing or unreadable one (the launcher calls it
before any actor starts); `load_reference` fills a built model with those weights on one trainer rank.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

from glue.trainer.checkpointing import DIST, load_module

# config.json fields that decide the parameter shapes: a reference that differs in one cannot share the policy's model
SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "num_experts", "moe_intermediate_size", "tie_word_embeddings")
ACCEPTED = ("an HF checkpoint directory (config.json + *.safetensors), a sluice checkpoint (a step_<N> folder with "
            "dist/), or a folder of them (a run's checkpoints/ or the run folder itself: the newest is taken)")


@dataclass(frozen=True)
class RefCheckpoint:
    kind: str  # "hf" or "sluice"
    path: str  # the HF directory, or the sluice checkpoint's step folder


def resolve_ref_load(path: str) -> RefCheckpoint:
    """What `trainer.ref_load` names; ValueError / FileNotFoundError in one line saying what was found instead."""
    where = f"trainer.ref_load={path!r}"
    if not os.path.exists(path):
        raise FileNotFoundError(f"{where} does not exist; give {ACCEPTED}")
    if not os.path.isdir(path):
        raise ValueError(f"{where} is a file, not a directory; give {ACCEPTED}")
    if os.path.isdir(os.path.join(path, DIST)):
        return RefCheckpoint("sluice", path)
    if os.path.isfile(os.path.join(path, "config.json")):
        if not glob.glob(os.path.join(path, "*.safetensors")):
            raise ValueError(f"{where} has config.json but no *.safetensors weights; save the model with "
                             "save_pretrained(safe_serialization=True)")
        return RefCheckpoint("hf", path)
    steps = _sluice_steps(path) or _sluice_steps(os.path.join(path, "checkpoints"))
    if steps:
        return RefCheckpoint("sluice", steps[-1])
    if os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")):
        raise ValueError(f"{where} is a Megatron-LM checkpoint (latest_checkpointed_iteration.txt), which sluice does "
                         "not read; convert it to HF (slime's tools/convert_torch_dist_to_hf.py) and give that folder")
    raise ValueError(f"{where} is neither an HF checkpoint nor a sluice checkpoint (found {_listing(path)}); give "
                     f"{ACCEPTED}")


def _sluice_steps(folder: str) -> list[str]:
    """The complete sluice checkpoints in `folder` (step_<N> with state.json and dist/), oldest first."""
    if not os.path.isdir(folder):
        return []
    found = [os.path.join(folder, name) for name in os.listdir(folder) if name.startswith("step_")
             and os.path.isfile(os.path.join(folder, name, "state.json"))
             and os.path.isdir(os.path.join(folder, name, DIST))]
    return sorted(found, key=lambda p: int(os.path.basename(p).split("_")[1]))


def _listing(path: str) -> str:
    names = sorted(os.listdir(path))
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") if names else "an empty folder"


def check_same_shapes(ref: RefCheckpoint, policy_dir: str) -> None:
    """The reference must have the policy's architecture: ValueError naming the first field that differs."""
    config_dir = ref.path if ref.kind == "hf" else os.path.join(ref.path, "hf_config")
    ref_config_path = os.path.join(config_dir, "config.json")
    if not os.path.isfile(ref_config_path):
        return  # a sluice checkpoint written without its config files: megatron's load checks the shapes
    with open(ref_config_path) as handle:
        ref_config = json.load(handle)
    with open(os.path.join(policy_dir, "config.json")) as handle:
        policy_config = json.load(handle)
    for name in SHAPE_FIELDS:
        if ref_config.get(name) != policy_config.get(name):
            raise ValueError(f"trainer.ref_load={ref.path!r} is not the policy's architecture: {name} is "
                             f"{ref_config.get(name)!r} there and {policy_config.get(name)!r} in model.path "
                             f"{policy_dir!r}; the reference must be a checkpoint of the same model")


def load_reference(reference: Any, ref: RefCheckpoint, hf_config: Any, layout: Any) -> None:
    """Collective for a sluice checkpoint (every rank reads its shards of `dist/`, resharded to its layout); the
    weights only, never the optimizer state."""
    from glue.trainer import model  # lazy: megatron (the launcher imports this module to check the folder)

    if ref.kind == "hf":
        model.load_hf_weights(reference, ref.path, hf_config, layout)
        return
    from megatron.core import dist_checkpointing

    dist = os.path.join(ref.path, DIST)
    loaded = dist_checkpointing.load({"model": reference.sharded_state_dict()}, dist)["model"]
    load_module(reference, loaded, dist)
