"""Counts the bytes of the tensors that torch allocates while a `TensorCensus` is entered, for as long as each one
stays alive (the CPU counterpart of `torch.cuda.max_memory_allocated` over a window): used to assert how much a
weight sync holds at once by counting bytes, not by reading the process's resident memory."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorCensus(TorchDispatchMode):
    """While entered (on this thread), every tensor storage an aten op returns that none of its inputs owns (a fresh
    allocation, not a view or an in-place result) is counted until it is freed, whether that is inside or outside
    the window. `live`: bytes counted now; `peak`: the most at once; `largest`: the largest single allocation. The
    same census can be entered again (one per sync step); allocations outside torch's dispatcher (gloo's own
    buffers, malloc by C++ code) are not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = self.largest_elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        owned = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.data_ptr() in owned:
                continue
            owned.add(storage.data_ptr())  # an op returning two views of one new storage counts it once
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, nbytes)
            self.largest_elements = max(self.largest_elements, tensor.numel())
            weakref.finalize(storage, self._free, nbytes)
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset_peak(self) -> None:
        """Start a new window: the peak and largest from now on (what is still alive stays counted)."""
        self.peak, self.largest = self.live, 0
