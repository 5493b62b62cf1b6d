"""Delta sync: a bucket sent as only the elements that changed since the version every engine holds. The source
compares each packed bucket with its baseline copy bit for bit (`diff_bucket`) and, where that is smaller than the
bucket, sends per changed tensor its changed flat positions and their new values (`delta_tensors`); the engine
scatters them into its weights with `apply_delta`, an SGLang custom weight loader `(model, named_tensors)`.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from weight_sync.buckets import BucketLayout, TensorSlot, dtype_to_str, str_to_dtype

# The `load_format` a delta bucket's request carries: the loader's import path, as SGLang's --custom-weight-loader
# takes it (dotted, the function last).
DELTA_LOAD_FORMAT = "weight_sync.delta.apply_delta"
INDEX_SUFFIX = ".sluice_delta_index"  # "<name>.sluice_delta_index": flat positions of the changed elements
VALUES_SUFFIX = ".sluice_delta_values"  # "<name>.sluice_delta_values": their new values, in the weight's dtype
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # compare as integers: bit for bit


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(_BITS[tensor.element_size()])


def slot_view(flat: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """Slot `slot` of a packed uint8 bucket, flat, as its own dtype (a view)."""
    return flat[slot.offset: slot.offset + slot.nbytes].view(str_to_dtype(slot.dtype))


def diff_bucket(layout: BucketLayout, current: torch.Tensor, baseline: torch.Tensor
                ) -> list[tuple[TensorSlot, torch.Tensor]]:
    """(slot, int64 flat positions whose bits differ) for every tensor of the bucket with a change; `current` and
    `baseline` are the bucket packed (flat uint8, same device). A bucket of one element width (bf16 throughout, the
    usual case) is compared in one pass and the positions split by tensor afterwards: per tensor, the many small
    passes cost about twice as much."""
    sizes = {str_to_dtype(slot.dtype).itemsize for slot in layout.slots}
    if len(sizes) == 1:
        size = sizes.pop()
        word = _BITS[size]
        changed = (current[: layout.nbytes].view(word) != baseline[: layout.nbytes].view(word)).nonzero().reshape(-1)
        starts = torch.tensor([slot.offset // size for slot in layout.slots], dtype=torch.int64)
        owner = torch.bucketize(changed, starts, right=True) - 1
        counts = torch.bincount(owner, minlength=len(layout.slots)).tolist()
        pieces = changed.split(counts)
        return [(slot, piece - start) for slot, piece, start, n in zip(layout.slots, pieces, starts.tolist(), counts)
                if n]
    changes = []
    for slot in layout.slots:
        positions = (_bits(slot_view(current, slot)) != _bits(slot_view(baseline, slot))).nonzero().reshape(-1)
        if positions.numel():
            changes.append((slot, positions))
    return changes


def index_dtype(layout: BucketLayout) -> torch.dtype:
    """int32 positions unless a tensor of the bucket has 2**31 elements or more."""
    biggest = max((slot.nbytes // str_to_dtype(slot.dtype).itemsize for slot in layout.slots), default=0)
    return torch.int32 if biggest < 2**31 else torch.int64


def delta_nbytes(layout: BucketLayout, changes: Sequence[tuple[TensorSlot, torch.Tensor]]) -> int:
    """Bytes of the delta of `changes`: each changed element's position plus its value."""
    position = index_dtype(layout).itemsize
    return sum(p.numel() * (position + str_to_dtype(s.dtype).itemsize) for s, p in changes)


def delta_tensors(layout: BucketLayout, current: torch.Tensor, changes: Sequence[tuple[TensorSlot, torch.Tensor]]
                  ) -> list[tuple[str, torch.Tensor]]:
    """The delta as named tensors in wire order: 8-byte values, positions, then 4-, 2- and 1-byte values, so that
    every tensor starts at an offset its dtype can be viewed from when they are packed back to back."""
    wide = index_dtype(layout)
    positions = [(s.name + INDEX_SUFFIX, p.to(wide)) for s, p in changes]
    values: dict[int, list[tuple[str, torch.Tensor]]] = {8: [], 4: [], 2: [], 1: []}
    for s, p in changes:
        values[str_to_dtype(s.dtype).itemsize].append((s.name + VALUES_SUFFIX, slot_view(current, s).index_select(0, p)))
    return values[8] + positions + values[4] + values[2] + values[1]


def delta_layout(index: int, named: Iterable[tuple[str, torch.Tensor]]) -> BucketLayout:
    """The bucket layout that packs `named` back to back (the delta's own, announced to the engines)."""
    named = list(named)
    return BucketLayout.from_json(index, {"names": [n for n, _ in named],
                                          "dtypes": [dtype_to_str(t.dtype) for _, t in named],
                                          "shapes": [list(t.shape) for _, t in named]})


def apply_delta(model: torch.nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]],
                targets: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """SGLang custom weight loader: scatter each `<name>.sluice_delta_values` into the weight `<name>` at the flat
    positions `<name>.sluice_delta_index`. `targets`: name -> the tensor to write (default: the model's parameters
    by name). Everything is checked before anything is written (all or nothing). Returns the names written, in
    order."""
    positions, values = {}, {}
    for name, tensor in named_tensors:
        if name.endswith(INDEX_SUFFIX):
            positions[name[: -len(INDEX_SUFFIX)]] = tensor
        elif name.endswith(VALUES_SUFFIX):
            values[name[: -len(VALUES_SUFFIX)]] = tensor
        else:
            raise ValueError(f"delta loader: {name!r} is neither '<weight>{INDEX_SUFFIX}' nor '<weight>{VALUES_SUFFIX}'")
    if positions.keys() != values.keys():
        raise ValueError(f"delta loader: weights with positions but no values or the reverse: "
                         f"{sorted(positions.keys() ^ values.keys())[:5]}")
    targets = dict(model.named_parameters()) if targets is None else targets
    for name, where in positions.items():
        target = targets.get(name)
        if target is None:
            raise ValueError(f"delta loader: the model has no weight {name!r}")
        if values[name].dtype != target.dtype or values[name].numel() != where.numel():
            raise ValueError(f"delta loader: {name}: {where.numel()} positions, {values[name].numel()} "
                             f"{values[name].dtype} values for a {target.dtype} weight")
        if not target.is_contiguous():
            raise ValueError(f"delta loader: {name} is not contiguous, its flat positions do not address it")
        if where.numel() and not 0 <= int(where.min()) <= int(where.max()) < target.numel():
            raise ValueError(f"delta loader: {name}: positions outside its {target.numel()} elements")
    with torch.no_grad():
        for name, where in positions.items():
            target = targets[name]
            target.view(-1).index_copy_(0, where.to(device=target.device, dtype=torch.int64),
                                        values[name].to(target.device))
    return list(positions)
