"""Block-FP8 checkpoints (DeepSeek-V3 / R1, Kimi-K2, the Qwen3 `-FP8` releases): config.json's `quantization_config`
says `quant_method: fp8`, and each quantized linear weight `X.weight` is stored as float8_e4m3fn beside
`X.weight_scale_inv` (float32, one scale per weight_block_size block). Every reader of a checkpoint (the trainer, the
embedded engine, the plan) asks this module, and sees plain weights: the real value, dequantized to its own dtype.

Imports torch only (no transformers): a config is a config.json dict or an HF config object.
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
QUANTIZATION = "quantization_config"
SUPPORTED = "quant_method 'fp8', fmt 'e4m3', activation_scheme 'dynamic', weight_block_size [rows, cols]"


@dataclass(frozen=True)
class BlockFp8:
    """A block-FP8 checkpoint's format: each weight's [rows, cols] block shares one scale."""

    block: tuple[int, int]

    def describe(self) -> str:
        return f"block-FP8 (float8_e4m3fn weights, weight_scale_inv per {self.block[0]}x{self.block[1]} block)"

    def dequantize(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """`state` with every `X.weight` that has an `X.weight_scale_inv` replaced by its real value in `dtype`,
        and the scales dropped; every other tensor as it was. A scale without its weight, a quantized weight
        that is not float8_e4m3fn or a scale of the wrong shape is refused, naming the tensor."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if name.endswith(SCALE_SUFFIX):
                if name.removesuffix(SCALE_SUFFIX) not in state:
                    raise ValueError(f"{name}: a block-FP8 scale without its weight "
                                     f"{name.removesuffix(SCALE_SUFFIX)!r}; the checkpoint is incomplete")
                continue
            scale = state.get(name + SCALE_SUFFIX)
            out[name] = tensor if scale is None else dequantize_weight(tensor, scale, self.block, dtype, name)
        return out


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                      name: str = "weight") -> torch.Tensor:
    """weight [rows, cols] (float8_e4m3fn) times its block's scale (scale_inv [ceil(rows/b0), ceil(cols/b1)]; the
    last block of a dimension may be partial), computed in float32, returned in `dtype`."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} is {weight.dtype} beside its {name}{SCALE_SUFFIX}; a block-FP8 checkpoint stores "
                         "quantized weights as float8_e4m3fn")
    if weight.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(weight.shape)}; block-FP8 weights are dequantized as 2-d "
                         "[rows, cols] (one expert's linear at a time)")
    rows, cols = weight.shape
    expected = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, expected {expected} for a "
                         f"{rows}x{cols} weight in {block[0]}x{block[1]} blocks: does weight_block_size in "
                         "config.json match the checkpoint?")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def block_fp8_of(config: Any) -> BlockFp8 | None:
    """The block-FP8 format a checkpoint's config (config.json dict or HF config object) declares; None when it
    declares no quantization. Any quantization this module cannot dequantize is refused in one line naming the
    field."""
    quant = config.get(QUANTIZATION) if isinstance(config, dict) else getattr(config, QUANTIZATION, None)
    if quant is None:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    _require(quant, "quant_method", quant.get("quant_method") == "fp8")
    _require(quant, "fmt", quant.get("fmt", "e4m3") == "e4m3")
    _require(quant, "activation_scheme", quant.get("activation_scheme", "dynamic") == "dynamic")
    block = quant.get("weight_block_size")
    _require(quant, "weight_block_size", isinstance(block, (list, tuple)) and len(block) == 2
             and all(isinstance(b, int) and b > 0 for b in block))
    return BlockFp8(block=(block[0], block[1]))


def _require(quant: dict[str, Any], field: str, holds: bool) -> None:
    if not holds:
        raise ValueError(f"config.json {QUANTIZATION}.{field} is {quant.get(field)!r}: sluice loads block-FP8 "
                         f"checkpoints only ({SUPPORTED}); dequantize the checkpoint to bf16 first")


def read_block_fp8(model_dir: str) -> BlockFp8 | None:
    """The block-FP8 format of the checkpoint in `model_dir` (its config.json); None when it is not quantized."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return block_fp8_of(json.load(f))


def without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json dict that describes the dequantized model: the same, without quantization_config."""
    return {k: v for k, v in config.items() if k != QUANTIZATION}


def read_dequantized(model_dir: str, fp8: BlockFp8, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the block-FP8 checkpoint in `model_dir` (its *.safetensors files), on CPU, dequantized."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        state.update(load_file(path, device="cpu"))
    return fp8.dequantize(state, dtype)
