"""The engine's side of SGLang's weight routes: broadcast (join the trainer's group, receive a flat bucket or
named tensors), tensor handles (SGLang's flattened-bucket entries: a CUDA IPC bucket, or a shared-memory one kept
mapped, copied in), disk (load a safetensors checkpoint), and the weights checker. Each update answers with the
checksum of every bucket it received, computed here.

Blocking calls (they wait on the trainer); the server runs them in worker threads so the HTTP loop keeps serving.
"""
from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from glue.embedded_engine.checkpoint_names import checkpoint_tensors
from glue.embedded_engine.model_runner import ModelRunner
from weight_sync.broadcast import broadcast_bucket, receive_tensors, str_to_dtype
from weight_sync.buckets import BucketLayout, checksum, checksum_tensors, dtype_to_str, tensor_checksum, unpack_bucket
from weight_sync.delta import DELTA_LOAD_FORMAT, apply_delta
from weight_sync.disk import read_checkpoint
from weight_sync.ipc import MappedSegments, read_entries
from weight_sync.process_group import (WeightGroup, create_process_group, destroy_process_group,
                                       planned_device)

# SGLang request structs (io_struct.py) and the fields of each that the weight routes read, for the schema test.
WEIGHT_REQUEST_FIELDS = {
    "UpdateWeightsFromTensorReqInput": ("serialized_named_tensors", "load_format", "flush_cache",
                                        "abort_all_requests", "weight_version"),
    "UpdateWeightFromDiskReqInput": ("model_path", "load_format", "abort_all_requests", "weight_version",
                                     "flush_cache"),
    "CheckWeightsReqInput": ("action",),
    "UpdateWeightsFromDistributedReqInput": ("names", "dtypes", "shapes", "group_name", "load_format",
                                             "weight_version"),
}
LOAD_FORMATS = (None, "auto", "flattened_bucket")
# What the embedded engine accepts beyond SGLang: delta buckets, applied by sluice's loader (weight_sync.delta).
EMBEDDED_LOAD_FORMATS = (*LOAD_FORMATS, DELTA_LOAD_FORMAT)
CHECKSUM_THREADS = 2  # the engine's torch runs on one thread; while a bucket is checked nothing else runs


class ParameterBuckets:
    """The model's parameters re-homed, per bucket layout, as views of one flat buffer in bucket order, so that a
    broadcast bucket is received straight into the parameters: no receive buffer, no copy into the model. A layout
    gets a home on its first bucket (one copy) when every slot names a distinct parameter of that dtype and shape;
    a parameter moves to the newest layout that names it (older homes that held it are dropped)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.homes: dict[tuple, tuple[torch.Tensor, frozenset[int]]] = {}

    def home(self, layout: BucketLayout) -> torch.Tensor | None:
        """The flat buffer whose views are `layout`'s parameters, or None when the layout does not fit the model
        (the caller then loads through the checked copy path, which explains what is wrong). Call it with the
        model lock held."""
        key = tuple((s.name, s.dtype, s.shape) for s in layout.slots)
        if key in self.homes:
            return self.homes[key][0]
        params = dict(self.model.named_parameters(remove_duplicate=False))
        chosen = [params.get(s.name) for s in layout.slots]
        if not chosen or any(p is None for p in chosen) or len({id(p) for p in chosen}) != len(chosen):
            return None
        if any(tuple(p.shape) != s.shape or dtype_to_str(p.dtype) != s.dtype or p.device != chosen[0].device
               for p, s in zip(chosen, layout.slots)):
            return None
        flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=chosen[0].device)
        with torch.no_grad():
            for param, (_, view) in zip(chosen, unpack_bucket(layout, flat)):
                view.copy_(param.data)
                param.data = view
        ids = frozenset(id(p) for p in chosen)
        self.homes = {k: v for k, v in self.homes.items() if not v[1] & ids}
        self.homes[key] = (flat, ids)
        return flat


def on_every_rank(groups: list[WeightGroup], first: Callable[[WeightGroup], Any],
                  others: Callable[[WeightGroup], Any]) -> Any:
    """Run one collective on every simulated TP rank at once (a collective returns only once all its members are
    in it): `first` on tp_rank 0 in this thread, `others` on the rest, one thread each; `first`'s result, and the
    first error of any rank raised here."""
    if len(groups) == 1:
        return first(groups[0])
    with ThreadPoolExecutor(max_workers=len(groups) - 1, thread_name_prefix="tp-rank") as pool:
        pending = [pool.submit(others, g) for g in groups[1:]]
        result = first(groups[0])
        for done in pending:
            done.result()
    return result


class WeightReceiver:
    """The weight groups this engine has joined, by name: one member per simulated TP rank (`tp_size`), each at
    rank `rank_offset + tp_rank` as SGLang's TP workers join. Every rank receives each broadcast; tp_rank 0's copy
    goes into the model (the engine holds one unsharded model), the other ranks' copies are discarded."""

    def __init__(self, runner: ModelRunner, *, timeout_s: float = 300.0, tp_size: int = 1,
                 bucket_checksums: bool = True):
        self.runner = runner
        self.timeout_s = timeout_s
        self.tp_size = tp_size
        # off for the strict face, which answers as SGLang does (no checksums): tensor and disk updates skip hashing
        self.bucket_checksums = bucket_checksums
        self.groups: dict[str, list[WeightGroup]] = {}
        self._lock = threading.Lock()  # one group change or one update at a time
        self._receive_buffer = torch.empty(0, dtype=torch.uint8)  # for buckets that do not fit the model
        self._homes = ParameterBuckets(runner.model)
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bucket-checksum")
        # the ipc sources' segments, kept mapped between buckets: up to two per TP rank (pipelined), each its own
        self._segments = MappedSegments(keep=4 * tp_size)

    def drop_parameter_homes(self) -> None:
        """Forget the flat buffers parameters were re-homed into, so released weights free their memory (a
        resumed parameter has new storage; the next broadcast re-homes it)."""
        with self._lock:
            self._homes.homes.clear()
            self._receive_buffer = torch.empty(0, dtype=torch.uint8)
            self._segments.clear()

    def prune_segments(self) -> None:
        """Unmap shared segments whose source closed them (skipped while an update holds the lock)."""
        if self._lock.acquire(blocking=False):
            try:
                self._segments.prune()
            finally:
                self._lock.release()

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> tuple[bool, str]:
        """`/init_weights_update_group`: join as ranks `rank_offset + tp_rank` (rank 0 is the trainer), all at once
        (a group forms only once every member has joined)."""
        with self._lock:
            if group_name in self.groups:
                return False, f"weight group {group_name!r} already exists; destroy it first or use another name"

            def join(tp_rank: int) -> WeightGroup:
                return create_process_group(master_address=master_address, master_port=master_port,
                                            rank=rank_offset + tp_rank, world_size=world_size, group_name=group_name,
                                            backend=backend, timeout_s=self.timeout_s,
                                            device=planned_device(tp_rank))

            with ThreadPoolExecutor(max_workers=self.tp_size, thread_name_prefix="tp-join") as pool:
                pending = [pool.submit(join, r) for r in range(self.tp_size)]
            joined, errors = [], []
            for done in pending:
                try:
                    joined.append(done.result())
                except (RuntimeError, ValueError) as e:  # answered as SGLang does: success false + message
                    errors.append(e)
            if errors:
                for group in joined:
                    destroy_process_group(group)
                return False, f"Failed to initialize custom process group: {errors[0]}"
            self.groups[group_name] = joined
            return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        with self._lock:
            groups = self.groups.pop(group_name, None)
            if groups is None:
                return False, "The group to be destroyed does not exist."
            for group in groups:
                destroy_process_group(group)
            return True, "Succeeded to destroy custom process group."

    def update_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                                weight_version: str | None, load_format: str | None = None
                                ) -> tuple[bool, str, list[str] | None, dict[str, float]]:
        """`/update_weights_from_distributed`: receive everything announced (so the trainer's broadcast always
        completes), then load it all or, if any name or shape does not fit the model, none. `flattened_bucket`
        receives one flat bucket in one collective, straight into the parameters when the bucket fits the model
        (`ParameterBuckets`), and reports its checksum. Also answers where the time went (`receive_s`,
        `copy_in_s`: everything after the bytes arrived, copy and checksum together; `checksum_s`: the checksum's own
        share of it)."""
        with self._lock:
            groups = self.groups.get(group_name)
            if groups is None:
                return False, (f"Group {group_name} not in {sorted(self.groups)}. "
                               "Please call `init_weights_update_group` first."), None, {}
            t0 = time.perf_counter()
            if load_format == DELTA_LOAD_FORMAT:
                return self._receive_delta(groups, names, dtypes, shapes, weight_version)
            if load_format != "flattened_bucket":
                receive = lambda g: receive_tensors(g, names, dtypes, shapes, src=0)  # noqa: E731
                named = on_every_rank(groups, receive, receive)
                return (*self.runner.load_weights(named, weight_version), None, {"receive_s": time.perf_counter() - t0})
            layout = BucketLayout.from_json(0, {"names": names, "dtypes": dtypes, "shapes": shapes})
            discard = lambda g: broadcast_bucket(g, torch.empty(layout.nbytes, dtype=torch.uint8), src=0)  # noqa: E731
            with self.runner.model_lock:  # no forward reads the parameters while they are overwritten
                home = self._homes.home(layout)
                if home is not None:
                    # A broken broadcast leaves this bucket's parameters partly written, as a failure between two
                    # buckets leaves the model half updated: the bridge then fails the sync, loudly.
                    on_every_rank(groups, lambda g: broadcast_bucket(g, home, src=0), discard)
                    if weight_version is not None:  # in the same lock hold: no forward sees new weights, old tag
                        self.runner.weight_version = weight_version
            if home is not None:
                t1 = time.perf_counter()
                sums = [checksum(home, CHECKSUM_THREADS)]
                checked_s = time.perf_counter() - t1
                timings = {"receive_s": t1 - t0, "copy_in_s": checked_s, "checksum_s": checked_s}
                return True, f"Succeeded to update {len(names)} parameter(s).", sums, timings
            if self._receive_buffer.numel() < layout.nbytes:
                self._receive_buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
            flat = self._receive_buffer[: layout.nbytes]
            on_every_rank(groups, lambda g: broadcast_bucket(g, flat, src=0), discard)
            received_s = time.perf_counter() - t0
            ok, message, sums, timings = self._load_with_checksum(layout, flat, weight_version)
            return ok, message, sums, {**timings, "receive_s": received_s}

    def _receive_delta(self, groups: list[WeightGroup], names: list[str], dtypes: list[str], shapes: list[list[int]],
                       weight_version: str | None) -> tuple[bool, str, list[str] | None, dict[str, float]]:
        """A delta bucket (weight_sync.delta): receive its positions and values as one flat bucket, scatter them into
        the weights they name (`apply_delta`, all or nothing), and report the checksum of those weights, whole, as
        they are now (what the source computed of its own). A delta with nothing in it moves no bytes."""
        t0 = time.perf_counter()
        layout = BucketLayout.from_json(0, {"names": names, "dtypes": dtypes, "shapes": shapes})
        if self._receive_buffer.numel() < layout.nbytes:
            self._receive_buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        flat = self._receive_buffer[: layout.nbytes]
        if layout.nbytes:
            discard = lambda g: broadcast_bucket(g, torch.empty(layout.nbytes, dtype=torch.uint8), src=0)  # noqa: E731
            on_every_rank(groups, lambda g: broadcast_bucket(g, flat, src=0), discard)
        t1 = time.perf_counter()
        with self.runner.model_lock:
            if "weights" in self.runner.released:
                return False, "the engine's weights are released; resume them before a delta update", None, {}
            targets = checkpoint_tensors(self.runner.model)
            try:
                written = apply_delta(self.runner.model, unpack_bucket(layout, flat), targets)
            except ValueError as e:
                return False, f"Failed to update parameter online: {e}", None, {}
            if weight_version is not None:  # in the same lock hold: no forward sees new weights, old tag
                self.runner.weight_version = weight_version
            sums = [checksum_tensors([targets[name] for name in written])]
        return True, f"Succeeded to update {len(written)} parameter(s) by delta.", sums, {
            "receive_s": t1 - t0, "copy_in_s": time.perf_counter() - t1}

    def update_from_tensor(self, *, handles: list[str], weight_version: str | None
                           ) -> tuple[bool, str, list[str], dict[str, float]]:
        """`/update_weights_from_tensor` with SGLang's `flattened_bucket` entries, one per simulated TP rank, each read
        as its rank would (weight_sync.ipc.read_entries; a bad payload raises ValueError): rank 0's bucket, a CUDA
        IPC tensor or a shared-memory segment kept mapped from earlier buckets (`MappedSegments`), is copied into
        the model while another thread checksums it, and the copy has finished when this answers (the source then
        reuses its buffer). A bucket that fits the model is copied in one piece into the parameters' flat home."""
        layout, per_rank = read_entries(handles, self.tp_size, [planned_device(r) for r in range(self.tp_size)])
        with self._lock:
            t0 = time.perf_counter()
            flat, *others = [self._bucket_of(layout, flattened) for flattened in per_rank]
            for rank, other in enumerate(others, start=1):  # one model stands for every rank: the others must agree
                if not torch.equal(other, flat):
                    raise ValueError(f"serialized_named_tensors[{rank}] holds other bytes than entry [0]: every TP "
                                     "rank's copy of a bucket must be the same bucket")
            with self.runner.model_lock:
                home = None if "weights" in self.runner.released else self._homes.home(layout)
                if home is not None:
                    pending = self._hash(flat)
                    home.copy_(flat)
                    _finish_copies(home, flat)
                    if weight_version is not None:  # in the same lock hold: no forward sees new weights, old tag
                        self.runner.weight_version = weight_version
            if home is None:
                answer = self._load_with_checksum(layout, flat, weight_version)
                _finish_copies(flat)
                return answer
            value, checksum_s = pending.result() if pending else (None, 0.0)
            return True, f"Succeeded to update {len(layout.slots)} parameter(s).", [value], {
                "copy_in_s": time.perf_counter() - t0, "checksum_s": checksum_s}

    def _hash(self, flat: torch.Tensor) -> Any:
        """The bucket's checksum, taken on the hasher thread (None when bucket checksums are off)."""
        return self._hasher.submit(_timed_checksum, flat) if self.bucket_checksums else None

    def _bucket_of(self, layout: BucketLayout, flattened: Any) -> torch.Tensor:
        """A rank's bucket: its CUDA IPC tensor, or its shared segment through a kept mapping."""
        if isinstance(flattened, torch.Tensor):
            return flattened[: layout.nbytes]
        return self._segments.open(flattened.sluice_shm, layout.nbytes)

    def _load_with_checksum(self, layout: BucketLayout, flat: torch.Tensor, weight_version: str | None
                            ) -> tuple[bool, str, list[str], dict[str, float]]:
        """Copy a bucket into the model while another thread checksums it (both only read it; torch releases the
        GIL in both)."""
        t0 = time.perf_counter()
        pending = self._hash(flat)
        ok, message = self.runner.load_weights(unpack_bucket(layout, flat), weight_version)
        value, checksum_s = pending.result() if pending else (None, 0.0)
        return ok, message, [value], {"copy_in_s": time.perf_counter() - t0, "checksum_s": checksum_s}

    def update_from_disk(self, *, model_path: str, weight_version: str | None) -> tuple[bool, str, list[str]]:
        """`/update_weights_from_disk`: every tensor of the checkpoint, all or nothing; one checksum per shard."""
        with self._lock:
            try:
                named, sums = read_checkpoint(model_path, with_checksums=self.bucket_checksums)
            except (OSError, ValueError, KeyError) as e:
                return False, f"cannot read the checkpoint at {model_path!r}: {e}", []
            ok, message = self.runner.load_weights(named, weight_version)
        return ok, message, sums

    def check_weights(self, action: str) -> dict[str, Any]:
        """SGLang's `/weights_checker` answer for action "checksum": per-tensor SHA-256 prefixes of the live weights
        by checkpoint name (what the trainer sends), taken between two forwards."""
        if action != "checksum":
            return {"success": False, "message": f"action {action!r} is not supported by the embedded engine; "
                                                 "use 'checksum'"}
        with self.runner.model_lock:
            sums = {n: tensor_checksum(t) for n, t in checkpoint_tensors(self.runner.model, with_tied_copies=False).items()}
        overall = hashlib.sha256()
        for name in sorted(sums):
            overall.update(name.encode())
            overall.update(sums[name].encode())
        info = {"checksums": sums, "per_gpu_checksum": overall.hexdigest(),
                "parallelism_info": [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                      "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]}
        return {"success": True, "message": f"checksums of {len(sums)} parameters", "ranks": [info],
                "per_engine_checksum": hashlib.sha256(info["per_gpu_checksum"].encode()).hexdigest()}

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy_group(name)
        self._segments.clear()


def _finish_copies(*tensors: torch.Tensor) -> None:
    """Wait for the device work queued on these tensors' GPUs: a CUDA copy out of the source's bucket is queued,
    and the source may overwrite the bucket once the engine answers."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)


def _timed_checksum(flat: torch.Tensor) -> tuple[str, float]:
    t0 = time.perf_counter()
    return checksum(flat), time.perf_counter() - t0


def check_update_payload(body: Any, load_formats: tuple = LOAD_FORMATS) -> str | None:
    """The first problem with an `/update_weights_from_distributed` body, or None. `load_formats`: those accepted
    (SGLang's by default; the embedded engine's own face adds delta buckets, `EMBEDDED_LOAD_FORMATS`)."""
    if not isinstance(body, dict):
        return "body must be a JSON object"
    for name in ("names", "dtypes", "shapes"):
        if not isinstance(body.get(name), list):
            return f"{name} must be a list (one entry per tensor)"
    if not all(isinstance(name, str) for name in body["names"]):
        return "names must be a list of strings (parameter names)"
    if not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
        return (f"names, dtypes and shapes must have the same length, got {len(body['names'])}, "
                f"{len(body['dtypes'])} and {len(body['shapes'])}")
    for shape in body["shapes"]:
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            return f"shapes must be lists of non-negative integers, got {shape!r}"
    for dtype in body["dtypes"]:
        try:
            str_to_dtype(dtype)
        except ValueError as e:
            return f"dtypes: {e}"
    version_problem = check_weight_version(body)
    if version_problem is not None:
        return version_problem
    if body.get("load_format") not in load_formats:
        return f"load_format {body['load_format']!r} is not supported by this engine; use one of {load_formats}"
    return None


def check_weight_version(body: dict[str, Any]) -> str | None:
    """The problem with an update body's optional `weight_version` (the tag its weights land with), or None."""
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        return f"weight_version must be a string like SGLang's, got {version!r}"
    return None
