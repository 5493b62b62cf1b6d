"""One trainer rank's part of a checkpoint (glue.checkpoint writes the folder): rank 0 writes every weight as an HF
safetensors checkpoint (`hf/`, which any TP/EP/DP layout reloads); each rank writes its optimizer shard (main weights, Adam moments, lr schedule) and RNG state, version
and layout (`trainer/rank_<r>.pt`, which needs the same layout)."""
from __future__ import annotations

import os
import shutil
from typing import Any

import torch


def save_rank(worker: Any, directory: str) -> None:
    """Collective (the weights are gathered from every rank). An offloaded trainer (colocated placement: the engines
    hold the devices now) is brought back for the gather and offloaded again; on GPU that needs room next to the
    engines."""
    offloaded = worker._offloaded is not None
    if offloaded:
        worker.onload()
    try:
        state = worker.full_hf_state()
        if worker.rank == 0:
            _write_hf(worker.model_path, state, os.path.join(directory, "hf"))
        os.makedirs(os.path.join(directory, "trainer"), exist_ok=True)
        torch.save({"optimizer": worker.training.state_dict(), "precision": worker.precision, "torch_rng": torch.get_rng_state(),
                    "version": worker.version, "layout": layout_key(worker)}, rank_file(directory, worker.rank))
    finally:
        if offloaded:
            worker.offload()


def load_rank(worker: Any, directory: str) -> int:
    """The weights at this rank's layout (whatever the saving layout), then this rank's optimizer and RNG state,
    which need the layout the checkpoint was taken at. Returns the version."""
    from glue.trainer import model

    path = rank_file(directory, worker.rank)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: the checkpoint was taken with fewer trainer ranks")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if saved["layout"] != layout_key(worker):
        raise ValueError(f"checkpoint {directory} was taken at trainer layout {saved['layout']}, this run is "
                         f"{layout_key(worker)}: the optimizer state is per rank, so resume at the same layout "
                         "(the weights alone reshard: start a new run with model.path=<checkpoint>/hf)")
    if saved.get("precision", worker.precision) != worker.precision:
        raise ValueError(f"checkpoint {directory} was trained in {saved['precision']}, this run in {worker.precision}: "
                         f"set trainer.precision: {saved['precision']} to resume it")
    model.load_hf_weights(worker.model, os.path.join(directory, "hf"), worker.hf_config, worker.place.layout())
    worker.training.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["torch_rng"])
    worker.version = int(saved["version"])
    if worker._snapshots is not None:
        worker._snapshots.save(worker.version, worker.model)
    return worker.version


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, "trainer", f"rank_{rank:05d}.pt")


def layout_key(worker: Any) -> dict[str, int]:
    p = worker.place
    return {"world_size": worker.world_size, "tp": p.tp_size, "pp": p.pp_size, "dp": p.dp_size, "ep": p.ep_size,
            "etp": p.etp_size}


def _write_hf(initial_model: str, state: dict[str, torch.Tensor], hf: str) -> None:
    """`state` as model.safetensors next to the initial model's config and tokenizer files."""
    from safetensors.torch import save_file

    os.makedirs(hf, exist_ok=True)
    for name in os.listdir(initial_model):
        source = os.path.join(initial_model, name)
        if os.path.isfile(source) and not name.endswith((".safetensors", ".bin", ".pt", ".safetensors.index.json")):
            shutil.copy(source, hf)
    save_file({n: t.contiguous() for n, t in state.items()}, os.path.join(hf, "model.safetensors"),
              metadata={"format": "pt"})
