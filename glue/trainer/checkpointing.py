"""One trainer rank's part of a checkpoint (glue.checkpoint writes the folder), with no gather:

- `dist/`: the model's weights in megatron-core's sharded format (`dist_checkpointing`, torch_dist): every rank
  writes its own shards (one replica of each: data-parallel copies are written once), and any TP / PP / EP layout
  reads them back (megatron reshards on load);
- `trainer/rank_<r>.pt`: this rank's optimizer shard (fp32 main weights and Adam moments: its share of them with the
  distributed optimizer), the lr schedule, precision, torch RNG state, policy version and layout;
- `hf_config/`: the initial model's config and tokenizer files (what `launch.export_hf` needs to write an HF
  directory from `dist/`, offline, tensor by tensor).

Resuming at the layout the checkpoint was taken at is exact. At another layout the weights reshard and the main
weights are taken from them; the Adam moments restart (they are per layout), which is said in one line.
Checkpoints written before `dist/` existed (an `hf/` directory) still load.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import torch

DIST, HF_CONFIG = "dist", "hf_config"


def save_rank(worker: Any, directory: str) -> None:
    """Collective: every rank writes its shards of the weights and its optimizer file. An offloaded trainer
    (colocated placement: the engines hold the devices now) is brought back for the write and offloaded again."""
    from megatron.core import dist_checkpointing

    offloaded = worker._offloaded is not None
    if offloaded:
        worker.onload()
    try:
        dist = os.path.join(directory, DIST)
        os.makedirs(dist, exist_ok=True)
        dist_checkpointing.save({"model": worker.model.sharded_state_dict()}, dist)
        if worker.rank == 0:
            _copy_config_files(worker.model_path, os.path.join(directory, HF_CONFIG))
        os.makedirs(os.path.join(directory, "trainer"), exist_ok=True)
        torch.save({"optimizer": worker.training.state_dict(), "precision": worker.precision,
                    "torch_rng": torch.get_rng_state(), "version": worker.version, "layout": layout_key(worker)},
                   rank_file(directory, worker.rank))
        if worker.critic is not None:
            worker.critic.save(directory, worker.rank)
    finally:
        if offloaded:
            worker.offload()


def load_rank(worker: Any, directory: str) -> int:
    """Collective: the weights at this rank's layout (whatever the saving layout), then this rank's optimizer and
    RNG state when the layout is the saving one. Returns the policy version."""
    from glue.trainer import model

    saved = _rank_state(worker, directory)
    if saved.get("precision", worker.precision) != worker.precision:
        raise ValueError(f"checkpoint {directory} was trained in {saved['precision']}, this run in {worker.precision}: "
                         f"set trainer.precision: {saved['precision']} to resume it")
    if os.path.isdir(os.path.join(directory, DIST)):
        load_sharded_weights(worker.model, os.path.join(directory, DIST))
    else:  # a checkpoint from before dist/: every weight in one HF directory
        model.load_hf_weights(worker.model, os.path.join(directory, "hf"), worker.hf_config, worker.place.layout())
    if saved["layout"] == layout_key(worker):
        worker.training.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["torch_rng"])
    else:
        worker.training.restart_from_weights(saved["optimizer"]["scheduler"])
        if worker.rank == 0:
            print(f"trainer: checkpoint {directory} was taken at layout {saved['layout']}, this run is "
                  f"{layout_key(worker)}: weights resharded, main weights taken from them, Adam moments restart",
                  flush=True)
    if worker.critic is not None:
        worker.critic.load(directory, worker.rank, same_layout=saved["layout"] == layout_key(worker))
    worker.version = int(saved["version"])
    if worker._snapshots is not None:
        worker._snapshots.save(worker.version, worker.model)
    return worker.version


def load_sharded_weights(module: torch.nn.Module, dist: str) -> None:
    """Collective: `module`'s parameters (this rank's shards) from a `dist/` checkpoint of any layout."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": module.sharded_state_dict()}, dist)["model"]
    missing, unexpected = module.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"{dist} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _rank_state(worker: Any, directory: str) -> dict[str, Any]:
    """This rank's file, or rank 0's when the checkpoint was taken with fewer ranks (version, schedule)."""
    path = rank_file(directory, worker.rank)
    if not os.path.exists(path):
        path = rank_file(directory, 0)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: {directory} is not a complete trainer checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False)


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, "trainer", f"rank_{rank:05d}.pt")


def layout_key(worker: Any) -> dict[str, int]:
    p = worker.place
    return {"world_size": worker.world_size, "tp": p.tp_size, "pp": p.pp_size, "dp": p.dp_size, "ep": p.ep_size,
            "etp": p.etp_size}


def _copy_config_files(initial_model: str, out: str) -> None:
    """The initial model's config, generation config and tokenizer files (everything but its weights)."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(initial_model):
        source = os.path.join(initial_model, name)
        if os.path.isfile(source) and not name.endswith((".safetensors", ".bin", ".pt", ".safetensors.index.json")):
            shutil.copy(source, out)
