"""Driver side of the three transports behind one small interface: `connect(urls)` opens a channel from the source
to those engines, `transfer(urls, weight_version)` moves every bucket once (the source sends, the engines load; the
last bucket's request carries the version), `disconnect(urls)`, `close()`. Each engine answers with the checksum of
every bucket it received; `transfer` returns both sides' lists.
"""
from __future__ import annotations

import itertools
import os
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from weight_sync.broadcast import abort_key
from weight_sync.buckets import BucketLayout
from weight_sync.engine_calls import WeightSyncError, call_update, run_together


class WeightSource(Protocol):
    """The trainer as the bridge sees it (blocking calls). `TrainerGroup` and `LocalWeightSource` implement it.

    A source on another node may also offer `weight_channel_address() -> (node address, free port there)`: the
    broadcast group is then hosted at its own node's address, which the driver cannot know or bind. A source with
    several ranks may offer `weight_source_plan() -> [(source rank, HF names it sends), ...]` for parallel sources
    (`weight_sync.parallel`); then `weight_channel_address(rank)` and a channel spec's `source` name the rank.
    """

    def hf_weight_specs(self) -> list[tuple[str, str, tuple[int, ...]]]: ...
    def open_weight_channel(self, name: str, spec: Mapping[str, Any]) -> None: ...
    def stage_weights(self, with_tensor_checksums: bool = False) -> dict[str, str] | None: ...  # None: the
    # source streams, and each bucket's per-tensor checksums come back with it (`tensor_sums`)
    def send_weight_bucket(self, channel: str, index: int) -> dict[str, Any]: ...
    def close_weight_channel(self, name: str) -> None: ...


@dataclass
class Transfer:
    """One transfer's checksums (the source's per bucket, each engine's per bucket) and where its time went:
    seconds summed over buckets of the source's packing, checksums and wire (from a broadcast's start to its end),
    and of the slowest engine's copy-in (its work once the bytes arrived: the copy into the model and the checksum,
    side by side where they overlap). Stages overlap when the
    transfer is pipelined, so these add up to more than the transfer took."""

    source: list[str | None] = field(default_factory=list)
    engines: dict[str, list[str | None]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    engine_seconds: dict[str, float] = field(default_factory=dict, repr=False)  # copy-in (with checksums), per engine
    tensor_sums: dict[str, str] = field(default_factory=dict, repr=False)  # a streaming source's per-tensor sums
    delta: dict[str, float] = field(default_factory=dict)  # delta sync: elements, changed and bytes_sent, summed

    def add_prepared(self, prepared: Mapping[str, Any]) -> None:
        for key in ("elements", "changed", "bytes_sent"):
            self.delta[key] = self.delta.get(key, 0.0) + float(prepared[key])

    def add_source(self, sent: Mapping[str, Any]) -> None:
        self.source.append(sent["checksum"])
        self.tensor_sums.update(sent.get("tensor_sums") or {})
        for key, out in (("pack_s", "pack_s"), ("checksum_s", "source_checksum_s"), ("wire_s", "wire_s")):
            self.timings[out] = self.timings.get(out, 0.0) + float(sent.get(key, 0.0))

    def add_engines(self, urls: Sequence[str], answers: Sequence[Mapping[str, Any]], buckets: int) -> None:
        for url, answer in zip(urls, answers):
            self.engines[url] += _reported(answer, buckets, url)
            spent = float(answer.get("copy_in_s", 0.0))  # copy and checksum together (they may overlap)
            self.engine_seconds[url] = self.engine_seconds.get(url, 0.0) + spent
        self.timings["copy_in_s"] = max(self.engine_seconds.values(), default=0.0)


class Transport(Protocol):
    def connect(self, urls: Sequence[str]) -> None: ...
    def transfer(self, urls: Sequence[str], weight_version: str) -> Transfer: ...
    def disconnect(self, urls: Sequence[str]) -> list[str]: ...  # what engines could not undo, one line each
    def close(self) -> None: ...


GROUP_PREFIX = "sluice_weights"  # one source's weight groups are named <prefix>_<driver pid>_<n>


def engine_rank_offset(engine: int, ranks_per_engine: int) -> int:
    """Where engine `engine` (in list order) joins a weight group: rank 0 is the source, then each engine's TP
    ranks, as SGLang joins them (rank_offset + tp_rank). `engine_rank_offset(n, ...)` is the world size of n."""
    return 1 + engine * ranks_per_engine


LEAVE_TIMEOUT_S = 10.0  # how long an engine gets to leave a weight group; one that does not answer is left behind


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class _Base:
    def __init__(self, source: WeightSource, layouts: list[BucketLayout], *, with_checksum: bool, timeout_s: float,
                 key: str | None = None, pipeline: bool = True):
        self.source, self.layouts = source, layouts
        self.with_checksum, self.timeout_s = with_checksum, timeout_s
        self.pipeline = pipeline  # overlap bucket k+1's packing with bucket k's wire and the engines' copy-in
        self.key = key  # bearer key of the engines' weight routes (admin routes: `engine_calls.admin_key`)
        self._pool_size = 16
        self._pool = ThreadPoolExecutor(max_workers=self._pool_size, thread_name_prefix="weight-sync")

    def _together(self, calls: Sequence[Any], on_failure: Any = None) -> list[Any]:
        """Run calls side by side (`run_together`: the first failure is raised at once, after `on_failure` told the
        others to leave). The pool grows to the widest set of calls: the source and every engine must be inside one
        collective at once, and a call left queued behind a full pool would deadlock the others."""
        if len(calls) > self._pool_size:
            self._pool.shutdown(wait=False)
            self._pool_size = len(calls)
            self._pool = ThreadPoolExecutor(max_workers=self._pool_size, thread_name_prefix="weight-sync")
        return run_together(calls, self.timeout_s, self._pool, on_failure)


    def _spec(self, kind: str, **extra: Any) -> dict[str, Any]:
        return {"kind": kind, "layouts": [b.to_json() for b in self.layouts], "with_checksum": self.with_checksum,
                "pipeline": self.pipeline, **extra}

    def _on_engines(self, urls: Sequence[str], route: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        calls = [lambda url=url: call_update(url, route, payload, self.timeout_s, self.key) for url in urls]
        return self._together(calls)

    def _flags(self, index: int, weight_version: str) -> dict[str, Any]:
        """The last bucket carries `weight_version`: the engine tags its weights in the same step that completes
        them, so no forward runs on new weights under the old tag. It also flushes the prefix cache, once. Never
        abort requests (the controller has paused generation already, in the mode it chose)."""
        if index != len(self.layouts) - 1:
            return {"flush_cache": False, "abort_all_requests": False}
        return {"flush_cache": True, "abort_all_requests": False, "weight_version": weight_version}

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _reported(answer: dict[str, Any], expected: int, url: str) -> list[str | None]:
    sums = answer.get("checksums")
    if sums is None:
        return [None] * expected  # an engine that does not report (SGLang); verification says so if it is on
    if len(sums) != expected:
        raise WeightSyncError(f"engine {url} reported {len(sums)} bucket checksums for {expected} buckets")
    return list(sums)


class BroadcastTransport(_Base):
    """A weight group `[source, engine_0's ranks, engine_1's ranks, ...]` per connected engine list; one broadcast
    per bucket. An engine joins with each of its `ranks_per_engine` tensor-parallel ranks, as SGLang does (rank =
    rank_offset + tp_rank), so engine i starts at rank 1 + i x ranks_per_engine. Groups are created one at a time
    and every member joins in the same call, so two groups never wait on each other."""

    def __init__(self, source: WeightSource, layouts: list[BucketLayout], *, backend: str, master_address: str | None,
                 with_checksum: bool, timeout_s: float, ranks_per_engine: int = 1, key: str | None = None,
                 pipeline: bool = True, group_prefix: str = GROUP_PREFIX):
        super().__init__(source, layouts, with_checksum=with_checksum, timeout_s=timeout_s, key=key,
                         pipeline=pipeline)
        self.backend, self.master_address = backend, master_address
        self.ranks_per_engine = ranks_per_engine
        self.address: tuple[str, int] | None = None  # (host, port) of the newest group, for logs and tests
        self.groups: dict[tuple[str, ...], str] = {}
        self._addresses: dict[str, tuple[str, int]] = {}  # group name -> where its store is hosted
        self._names = (f"{group_prefix}_{os.getpid()}_{i}" for i in itertools.count())

    def connect(self, urls: Sequence[str]) -> None:
        key = tuple(urls)
        if key in self.groups:
            return
        name, (host, port) = next(self._names), self._group_address()
        world_size = engine_rank_offset(len(urls), self.ranks_per_engine)
        spec = self._spec("broadcast", master_address=host, master_port=port,
                          world_size=world_size, group_name=name, backend=self.backend, timeout_s=self.timeout_s)
        engine_calls = [
            lambda url=url, rank=engine_rank_offset(i, self.ranks_per_engine): call_update(
                url, "/init_weights_update_group", {
                    "master_address": host, "master_port": port, "rank_offset": rank,
                    "world_size": world_size, "group_name": name, "backend": self.backend}, self.timeout_s, self.key)
            for i, url in enumerate(urls)]
        self._together([lambda: self.source.open_weight_channel(name, spec), *engine_calls])
        self.groups[key] = name
        self._addresses[name] = (host, port)

    def _group_address(self) -> tuple[str, int]:
        """Where the source hosts the group: its own node's address and a port free there when it can tell (a
        trainer rank 0 on another node), with `master_address` overriding the host (machines with several
        networks); else `master_address` (default loopback) and a port free on this host."""
        where = getattr(self.source, "weight_channel_address", None)
        if where is not None:
            host, port = where()
            self.address = (self.master_address or host, port)
        else:
            host = self.master_address or "127.0.0.1"
            self.address = (host, free_port(host))
        return self.address

    def transfer(self, urls: Sequence[str], weight_version: str, delta: bool | None = None) -> Transfer:
        """Bucket by bucket, the source and every engine enter the bucket's broadcast together; the next bucket's
        requests go out once every engine has answered, so each engine takes them in order (a request carries no
        bucket index). The overlap is the source's: it packs ahead of the wire (`channels.BroadcastChannel`).
        `delta` (delta sync on; None: off): the source first chooses each bucket's form, whole or, when True and
        smaller, its changes since the last sync (`weight_sync.delta`), and the bucket's requests announce that
        form."""
        if tuple(urls) not in self.groups:  # never connected, or dropped by a failed transfer: a fresh group
            self.connect(urls)
        name = self.groups[tuple(urls)]
        result = Transfer(engines={url: [] for url in urls})
        for layout in self.layouts:
            if delta is None:
                payload = {**layout.to_json(), "group_name": name, "load_format": "flattened_bucket",
                           **self._flags(layout.index, weight_version)}
                del payload["offsets"]  # SGLang's struct has no such field; packing order defines them
            else:
                prepared = self.source.prepare_weight_bucket(name, layout.index, delta)
                result.add_prepared(prepared)
                payload = {key: prepared[key] for key in ("names", "dtypes", "shapes", "load_format")}
                payload.update(group_name=name, **self._flags(layout.index, weight_version))
            calls = [lambda: self.source.send_weight_bucket(name, layout.index)]
            calls += [lambda url=url: call_update(url, "/update_weights_from_distributed", payload, self.timeout_s,
                                                  self.key) for url in urls]
            aborted: list[bool] = []
            try:
                sent, *answers = self._together(calls, on_failure=lambda: aborted.append(True) or self._abort(name))
            except Exception as err:
                if aborted:  # members were told to leave a broadcast midway: the group is spent, a fresh one follows
                    for problem in self._drop_group(tuple(urls)):
                        err.add_note(problem)
                raise
            result.add_source(sent)
            result.add_engines(urls, answers, 1)
        return result

    def _abort(self, name: str) -> None:
        """Tell every member of group `name` still inside a broadcast to leave it (`broadcast.abort_key`): one side
        failed or refused, so the others would otherwise wait out the collective's timeout."""
        import datetime

        import torch.distributed as dist

        host, port = self._addresses[name]
        try:  # a plain connect first: torch prints a C++ stack trace for a store it cannot reach
            socket.create_connection((host, port), timeout=5).close()
        except OSError:
            return  # the store went with its host, the source (a trainer rank that died): no member waits on it
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10),
                              wait_for_workers=False)
        store.set(abort_key(name), "1")

    def _drop_group(self, urls: tuple[str, ...]) -> list[str]:
        """Forget a group a failed transfer broke (`disconnect`); the next connect() builds a fresh group."""
        return self.disconnect(urls)

    def disconnect(self, urls: Sequence[str]) -> list[str]:
        """Close the group of `urls`: the source closes its side and every engine is asked to leave, side by side (a
        member's side of a group with a broadcast still pending closes only once its peers close theirs). An engine
        that does not answer within `LEAVE_TIMEOUT_S` (hung, or gone) keeps its side until its own timeout or exit;
        that is returned, one line per engine, not raised: the others' group must be rebuilt without it."""
        name = self.groups.pop(tuple(urls), None)
        if name is None:
            return []
        self._addresses.pop(name, None)
        leave = [lambda url=url: self._leave(url, name) for url in urls]
        problems = run_together([lambda: self.source.close_weight_channel(name), *leave], self.timeout_s)
        return [problem for problem in problems if problem]

    def _leave(self, url: str, name: str) -> str | None:
        try:
            call_update(url, "/destroy_weights_update_group", {"group_name": name},
                        min(self.timeout_s, LEAVE_TIMEOUT_S), self.key)
        except WeightSyncError as err:
            return f"{url} could not leave weight group {name!r}: {err}"
        return None

    def close(self) -> None:
        for key in list(self.groups):
            self.disconnect(list(key))
        super().close()


class PointToPoint(_Base):
    """A transport whose source keeps one channel open across syncs (`CHANNEL`, opened with `_channel_spec()`);
    engines need nothing per connection."""

    CHANNEL = ""

    def __init__(self, source: WeightSource, layouts: list[BucketLayout], *, with_checksum: bool, timeout_s: float,
                 key: str | None = None, pipeline: bool = True):
        super().__init__(source, layouts, with_checksum=with_checksum, timeout_s=timeout_s, key=key,
                         pipeline=pipeline)
        self._open = False

    def _channel_spec(self) -> dict[str, Any]:
        raise NotImplementedError

    def connect(self, urls: Sequence[str]) -> None:
        if not self._open:
            self.source.open_weight_channel(self.CHANNEL, self._channel_spec())
            self._open = True

    def disconnect(self, urls: Sequence[str]) -> list[str]:
        """Point to point: nothing per engine to undo."""
        return []

    def close(self) -> None:
        if self._open:
            self.source.close_weight_channel(self.CHANNEL)
            self._open = False
        super().close()


class DiskTransport(PointToPoint):
    """The source writes a safetensors checkpoint (one shard per bucket) and renames it into place; every engine
    then loads it through `/update_weights_from_disk`."""

    CHANNEL = "disk"

    def __init__(self, source: WeightSource, layouts: list[BucketLayout], *, directory: str | None,
                 with_checksum: bool, timeout_s: float, key: str | None = None):
        super().__init__(source, layouts, with_checksum=with_checksum, timeout_s=timeout_s, key=key)
        self.directory = directory or tempfile.mkdtemp(prefix="sluice-weights-")

    def _channel_spec(self) -> dict[str, Any]:
        return self._spec("disk", dir=self.directory)

    def transfer(self, urls: Sequence[str], weight_version: str) -> Transfer:
        result = Transfer(engines={})
        sent: dict[str, Any] = {}
        for layout in self.layouts:
            sent = self.source.send_weight_bucket(self.CHANNEL, layout.index)
            result.add_source(sent)
        payload = {"model_path": sent["path"], **self._flags(len(self.layouts) - 1, weight_version)}
        result.engines = {url: [] for url in urls}
        result.add_engines(urls, self._on_engines(urls, "/update_weights_from_disk", payload), len(self.layouts))
        return result
