"""One trainer rank's part of a checkpoint (glue.loop.checkpoint writes the folder), with no gather:

- `dist/`: the model's weights and the optimizer's state (fp32 main weights, Adam moments and step, shaped like the
  parameters: megatron's `fully_reshardable` form) in megatron-core's sharded format (`dist_checkpointing`,
  torch_dist): every rank writes its own weight shards (one replica of each: data-parallel copies are written once),
  and any TP / PP / DP / EP layout reads them back (megatron reshards on load);
- `trainer/rank_<r>.pt`: the lr schedule, precision, torch RNG state, policy version, layout and optimizer count;
- `hf_config/`: the initial model's config and tokenizer files (what `launch.tools.export_hf` needs to write an HF
  directory from `dist/`, offline, tensor by tensor), and its frozen tensors (a family's MTP layers), which every
  export copies unchanged (a block-FP8 model's dequantized, like everything the trainer loads).

Resuming at the layout the checkpoint was taken at is exact; at another layout weights, main weights and Adam
moments all reshard (the RNG state is per rank and restarts), except between layouts that chain megatron's
optimizers differently (expert parallelism on one side only), where the Adam moments restart with one line.
Checkpoints of earlier sluice versions (optimizer shards in the rank files) are refused with one line.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from weight_sync.families import family_of
from weight_sync.fp8_blocks import block_fp8_of

DIST, HF_CONFIG = "dist", "hf_config"
FROZEN = "frozen.safetensors"  # in hf_config/: the initial model's tensors the trainer does not build (MTP layers)


def save_rank(worker: Any, directory: str) -> None:
    """Collective: every rank writes its shards of the weights and its optimizer file. An offloaded trainer
    (colocated placement: the engines hold the devices now) is brought back for the write and offloaded again."""
    offloaded = worker._offloaded is not None
    if offloaded:
        worker.onload()
    try:
        dist = os.path.join(directory, DIST)
        os.makedirs(dist, exist_ok=True)
        save_sharded(worker.model, worker.training, dist)
        if worker.rank == 0:
            _copy_config_files(worker.model_path, os.path.join(directory, HF_CONFIG))
            _copy_frozen_tensors(worker.model_path, os.path.join(directory, HF_CONFIG), worker.hf_config,
                                 torch.bfloat16 if worker.precision == "bf16" else torch.float32)
        os.makedirs(os.path.join(directory, "trainer"), exist_ok=True)
        torch.save({"scheduler": worker.training.scheduler.state_dict(), "optimizers": worker.training.optimizer_count,
                    "precision": worker.precision,
                    "torch_rng": torch.get_rng_state(), "version": worker.version, "layout": layout_key(worker)},
                   rank_file(directory, worker.rank))
        if worker.critic is not None:
            worker.critic.save(directory, worker.rank)
    finally:
        if offloaded:
            worker.offload()


def load_rank(worker: Any, directory: str) -> int:
    """Collective: the weights and optimizer state at this rank's layout (whatever the saving layout), and the RNG
    state when the layout is the saving one. Returns the policy version."""
    saved = _rank_state(worker, directory)
    if "scheduler" not in saved:
        raise ValueError(f"{directory} was written by an earlier sluice (its optimizer state is not in dist/): resume "
                         f"it with that version, or start a new run from its weights (`sluice export-hf` then "
                         f"model.path)")
    if saved.get("precision", worker.precision) != worker.precision:
        raise ValueError(f"checkpoint {directory} was trained in {saved['precision']}, this run in {worker.precision}: "
                         f"set trainer.precision: {saved['precision']} to resume it")
    if saved["layout"] == layout_key(worker):
        torch.set_rng_state(saved["torch_rng"])
    if saved["optimizers"] == worker.training.optimizer_count:
        load_sharded(worker.model, worker.training, os.path.join(directory, DIST), saved["scheduler"])
    else:
        _load_weights_only(worker, directory, saved)
    if worker.critic is not None:
        worker.critic.load(directory, worker.rank)
    worker.version = int(saved["version"])
    if worker._snapshots is not None:
        worker._snapshots.save(worker.version, worker.model)
    return worker.version


def _load_weights_only(worker: Any, directory: str, saved: dict[str, Any]) -> None:
    """Collective: a layout that splits the optimizer differently (expert parallelism on one side only: megatron
    keeps routed experts in an optimizer of their own under EP) takes the weights, and the Adam moments restart."""
    from megatron.core import dist_checkpointing

    dist = os.path.join(directory, DIST)
    load_module(worker.model, dist_checkpointing.load({"model": worker.model.sharded_state_dict()}, dist)["model"],
                 dist)
    worker.training.restart_from_weights(saved["scheduler"])
    if worker.rank == 0:
        print(f"trainer: checkpoint {directory} was taken at layout {saved['layout']} with {saved['optimizers']} "
              f"optimizer(s), this run is {layout_key(worker)} with {worker.training.optimizer_count}: weights "
              f"resharded, main weights taken from them, Adam moments restart", flush=True)


def save_sharded(module: torch.nn.Module, training: Any, dist: str) -> None:
    """Collective: `module`'s weight shards and its optimizer's state (glue.trainer.optim.Training) into `dist`."""
    from megatron.core import dist_checkpointing

    model_sharded = module.sharded_state_dict()
    dist_checkpointing.save({"model": model_sharded, "optimizer": training.sharded_state_dict(model_sharded)}, dist)


def load_sharded(module: torch.nn.Module, training: Any, dist: str, scheduler_state: dict[str, Any]) -> None:
    """Collective: this rank's weights and optimizer state from `dist`, resharded to its layout, and the schedule."""
    from megatron.core import dist_checkpointing

    model_sharded = module.sharded_state_dict()
    wanted = {"model": model_sharded, "optimizer": training.sharded_state_dict(model_sharded, is_loading=True)}
    loaded = dist_checkpointing.load(wanted, dist)
    load_module(module, loaded["model"], dist)
    training.load_sharded_state_dict(loaded["optimizer"], scheduler_state)


def load_module(module: torch.nn.Module, loaded: dict[str, Any], dist: str) -> None:
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


def _copy_frozen_tensors(initial_model: str, out: str, hf_config: Any, dtype: torch.dtype) -> None:
    """The initial model's tensors its family keeps frozen (weight_sync.families: MTP layers), into `out`/FROZEN;
    a block-FP8 model's dequantized to `dtype` (the trainer's), as the trained weights are."""
    import glob

    from safetensors import safe_open
    from safetensors.torch import save_file

    family, frozen = family_of(hf_config), {}
    for path in sorted(glob.glob(os.path.join(initial_model, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            frozen.update({n: f.get_tensor(n) for n in f.keys() if family.is_frozen(hf_config, n)})
    fp8 = block_fp8_of(hf_config)
    if fp8 is not None:
        frozen = fp8.dequantize(frozen, dtype)
    if frozen:
        save_file(frozen, os.path.join(out, FROZEN), metadata={"format": "pt"})


def _copy_config_files(initial_model: str, out: str) -> None:
    """The initial model's config, generation config and tokenizer files (everything but its weights)."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(initial_model):
        source = os.path.join(initial_model, name)
        if os.path.isfile(source) and not name.endswith((".safetensors", ".bin", ".pt", ".safetensors.index.json")):
            shutil.copy(source, out)
