"""`sluice export-hf CHECKPOINT OUT_DIR`: a trainer checkpoint's sharded weights (`dist/`, megatron-core's
dist_checkpointing format, any TP / PP / EP layout) as an HF directory that `transformers` loads: sharded
safetensors files with their index, and the initial model's config and tokenizer files (`hf_config/`). A block-FP8
initial model (weight_sync.fp8_blocks) is exported as it was loaded and trained: dequantized, in the trainer's dtype,
its config.json without quantization_config.

Offline and weight by weight: one process, a gloo group of one, the model built on the meta device (no memory), and
one stored tensor at a time read from `dist/` (megatron reshards it to one rank: a layer's weight, or one weight
kind of every layer where megatron stacks alike layers), converted to HF names (weight_sync.convert) and appended to
the current output file. Peak memory is about one stored tensor plus one output file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import sys
from typing import Any

import torch

from glue.trainer import cpu_compat
from glue.trainer import model as trainer_model
from glue.trainer.checkpointing import DIST, FROZEN, HF_CONFIG, rank_file
from weight_sync.convert import rules
from weight_sync.convert.mapping import rule_to_hf
from weight_sync.fp8_blocks import read_block_fp8, without_quantization

SHARD_BYTES = 2 << 30  # bytes per output safetensors file


def export(checkpoint: str, out: str, *, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write `checkpoint` (a `step_<N>` folder, or its `dist/`'s parent) to `out` as an HF directory; returns the
    safetensors file names written. Starts and ends its own single-process gloo group."""
    dist, config_dir = os.path.join(checkpoint, DIST), os.path.join(checkpoint, HF_CONFIG)
    for need in (dist, config_dir, rank_file(checkpoint, 0)):
        if not os.path.exists(need):
            raise FileNotFoundError(f"{need} is missing: {checkpoint} is not a sharded sluice checkpoint "
                                    "(checkpoints/step_<N> of a run)")
    os.makedirs(out, exist_ok=True)
    with _single_rank():
        files = _write_safetensors(dist, config_dir, trained_precision(checkpoint), out, shard_bytes)
    for name in os.listdir(config_dir):
        if name != FROZEN:  # written into the weight files above
            shutil.copy(os.path.join(config_dir, name), out)
    if read_block_fp8(config_dir) is not None:  # the weights were written dequantized: config.json says so
        with open(os.path.join(out, "config.json")) as f:
            config = without_quantization(json.load(f))
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return files


def trained_precision(checkpoint: str) -> str:
    """The precision the checkpoint's trainer ran in (bf16 / fp32): the dtype of its weights and of the export."""
    return torch.load(rank_file(checkpoint, 0), map_location="cpu", weights_only=False).get("precision", "fp32")


def dequantized_note(checkpoint: str) -> str:
    """What the export line adds for a block-FP8 initial model: its weights are written as loaded and trained."""
    if read_block_fp8(os.path.join(checkpoint, HF_CONFIG)) is None:
        return ""
    return (f"; the initial model was block-FP8: its weights are written dequantized, in the trainer's "
            f"{trained_precision(checkpoint)}, and config.json has no quantization_config")


def _write_safetensors(dist: str, config_dir: str, precision: str, out: str, shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    hf_config = trainer_model.read_hf_config(config_dir)
    with torch.device("meta"):
        meta = trainer_model.build_model(hf_config, tp_size=1, precision=precision)
    sharded = meta.sharded_state_dict()
    files: list[str] = []
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in pending.items()}, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({n: name for n in pending})
        files.append(name)
        pending.clear()

    # megatron stores a weight of every layer as one tensor (a layer axis in front) when the layers are alike: such
    # a key is read whole (all its layers, one weight kind); per-layer keys (e.g. MoE layers) one layer at a time
    by_key: dict[str, list[tuple[Any, str]]] = {}
    for rule in rules(hf_config):
        name = rule.megatron_name(rule.layer, rule.expert)
        by_key.setdefault(sharded[name].key, []).append((rule, name))
    for members in by_key.values():
        loaded = _load(dist, {name: sharded[name] for _, name in members})
        for rule, name in members:
            pending.update(rule_to_hf(rule, [loaded.pop(name)], hf_config))
        if sum(t.numel() * t.element_size() for t in pending.values()) >= shard_bytes:
            flush()
    frozen = os.path.join(config_dir, FROZEN)
    if os.path.exists(frozen):  # the family's frozen layers (MTP), unchanged from the initial model
        from safetensors.torch import load_file

        pending.update(load_file(frozen))
    if pending or not files:
        flush()
    return _name_files(out, files, weight_map)


def _load(dist: str, wanted: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`wanted` (meta sharded tensors of a one-rank model) read from `dist`, as real CPU tensors."""
    from megatron.core import dist_checkpointing

    real = {name: dataclasses.replace(item, data=torch.empty(item.data.shape, dtype=item.data.dtype, device="cpu"))
            for name, item in wanted.items()}
    return dist_checkpointing.load(real, dist, validate_access_integrity=False)  # a slice of the model, on purpose


def _name_files(out: str, files: list[str], weight_map: dict[str, str]) -> list[str]:
    """Rename model-0000i.safetensors to transformers' model-0000i-of-0000n form and write the index."""
    if len(files) == 1:
        os.replace(os.path.join(out, files[0]), os.path.join(out, "model.safetensors"))
        return ["model.safetensors"]
    final = {name: f"{name.removesuffix('.safetensors')}-of-{len(files):05d}.safetensors" for name in files}
    for old, new in final.items():
        os.replace(os.path.join(out, old), os.path.join(out, new))
    index = {"metadata": {}, "weight_map": {n: final[f] for n, f in weight_map.items()}}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return list(final.values())


class _single_rank:
    """A gloo process group of one and megatron's parallel state at size 1, for the duration of the block."""

    def __enter__(self) -> None:
        from megatron.core import parallel_state, tensor_parallel

        cpu_compat.apply()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0)

    def __exit__(self, *exc: Any) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice export-hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a run's checkpoints/step_<N> folder")
    parser.add_argument("out", help="the HF directory to write")
    parser.add_argument("--shard-gb", type=float, default=SHARD_BYTES / 2**30, help="GiB per safetensors file")
    args = parser.parse_args(argv)
    try:
        files = export(args.checkpoint, args.out, shard_bytes=int(args.shard_gb * 2**30))
    except (FileNotFoundError, ValueError) as err:
        print(f"sluice export-hf: {err}", file=sys.stderr)
        return 2
    print(f"sluice export-hf: {args.checkpoint} -> {args.out} ({len(files)} safetensors file(s))"
          f"{dequantized_note(args.checkpoint)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
