"""The ipc transport, for colocated engines: each engine TP rank reads every bucket through a handle of a copy on its
own GPU, made by the source rank there (one source per GPU), through SGLang's `/update_weights_from_tensor`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from weight_sync.buckets import BucketLayout
from weight_sync.engine_calls import WeightSyncError, call_update
from weight_sync.transports import PointToPoint, Transfer, WeightSource


def serve_map(ranks_of_engines: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """Which entries each source rank makes per bucket: for every engine (in order) and each of its TP ranks, the
    source rank on that rank's GPU makes the entry for that TP rank. {source rank: [TP rank, ...]}."""
    serve: dict[int, list[int]] = {}
    for ranks in ranks_of_engines:
        for tp_rank, source in enumerate(ranks):
            serve.setdefault(int(source), []).append(tp_rank)
    return serve


class IpcTransport(PointToPoint):
    """Colocated engines read each bucket where a source rank on their own GPU holds it: through
    `/update_weights_from_tensor`, one SGLang `flattened_bucket` entry per engine TP rank (CUDA IPC handles on GPU,
    shared-memory stand-ins on CPU; weight_sync.ipc), inside the bridge's weight-update session. `sources_of(url)`:
    the source rank on the GPU of each of the engine's TP ranks (the plan's colocation, one source per GPU; a source
    serves every engine rank on its own GPU, e.g. two engines sharing one); None: rank 0 serves every rank, which on
    CUDA reaches only the one engine rank on its GPU (CPU tests reach any). Each source rank reuses its buffers every sync:
    pipelined there are two, and it fills bucket k+1 into the other one while the engines copy bucket k out; the one
    it fills was released by every engine rank's answer to bucket k-1."""

    CHANNEL = "ipc"

    def __init__(self, source: WeightSource, layouts: list[BucketLayout], *, with_checksum: bool, timeout_s: float,
                 key: str | None = None, pipeline: bool = True, ranks_per_engine: int = 1,
                 sources_of: Callable[[str], Sequence[int]] | None = None):
        super().__init__(source, layouts, with_checksum=with_checksum, timeout_s=timeout_s, key=key,
                         pipeline=pipeline)
        self.ranks_per_engine = ranks_per_engine  # SGLang reads serialized_named_tensors[tp_rank]: one per rank
        self.planned = sources_of is not None  # a mapping from the placement: each source on its engine ranks' GPU
        self.sources_of = sources_of or (lambda url: [0] * ranks_per_engine)
        self.served: dict[int, list[int]] | None = None  # the open channel's serve_map

    def connect(self, urls: Sequence[str]) -> None:
        """Open the channel for exactly these engines' ranks (reopened when they change: an entry made for a rank
        that never reads it would hold a CUDA IPC reference for good)."""
        serve = serve_map([self._sources(url) for url in urls])
        if self._open and serve == self.served:
            return
        if self._open:
            self.source.close_weight_channel(self.CHANNEL)
            self._open = False
        self.served = serve
        self.source.open_weight_channel(self.CHANNEL, self._spec("ipc", tp_size=self.ranks_per_engine, serve=serve,
                                                                 tp_ranks=serve.get(0, [])))
        self._open = True

    def _sources(self, url: str) -> list[int]:
        ranks = list(self.sources_of(url))
        if len(ranks) != self.ranks_per_engine:
            raise WeightSyncError(f"ipc sources of engine {url}: {ranks} names {len(ranks)} source rank(s) for its "
                                  f"{self.ranks_per_engine} TP rank(s); give one per TP rank")
        return ranks

    def payloads(self, urls: Sequence[str], sent: Mapping[str, Any]) -> list[list[str]]:
        """Each engine's `serialized_named_tensors`: entry [t] from the source rank on its TP rank t's GPU."""
        by_rank = sent.get("handles_by_rank") or {0: sent["handles"]}
        taken = {rank: iter(entries) for rank, entries in by_rank.items()}
        payloads = [[next(taken[rank]) for rank in self._sources(url)] for url in urls]
        left = {rank: len(list(entries)) for rank, entries in taken.items()}
        assert not any(left.values()), f"entries made for no engine rank: {left} (each would hold a CUDA IPC reference)"
        return payloads

    def transfer(self, urls: Sequence[str], weight_version: str) -> Transfer:
        self.connect(urls)
        result = Transfer(engines={url: [] for url in urls})
        sent = self.source.send_weight_bucket(self.CHANNEL, 0) if self.layouts else {}
        crowded = any(len(tp) > 1 for tp in (self.served or {}).values())
        if sent.get("device") == "cuda" and crowded and not self.planned:
            raise WeightSyncError(
                f"ipc over CUDA: a source rank would serve {max(len(tp) for tp in self.served.values())} engine "
                "ranks from one GPU's buffer, but each engine rank must read a copy on its own GPU; give the bridge "
                "one source per GPU (launch plans it for colocated engines), or use the broadcast transport")
        for layout in self.layouts:
            result.add_source(sent)
            reading = [lambda url=url, entries=entries: call_update(url, "/update_weights_from_tensor", {
                           "serialized_named_tensors": entries, "load_format": "flattened_bucket",
                           **self._flags(layout.index, weight_version)}, self.timeout_s, self.key)
                       for url, entries in zip(urls, self.payloads(urls, sent))]
            has_next = layout.index + 1 < len(self.layouts)
            if self.pipeline and has_next:
                packing = [lambda index=layout.index + 1: self.source.send_weight_bucket(self.CHANNEL, index)]
                sent, *answers = self._together(packing + reading)
            else:
                answers = self._together(reading)
            result.add_engines(urls, answers, 1)
            if not self.pipeline and has_next:
                sent = self.source.send_weight_bucket(self.CHANNEL, layout.index + 1)
        return result

    def close(self) -> None:
        self.served = None
        super().close()


class IpcOrDisk:
    """ipc to the engines whose every rank shares a GPU with a source rank (`sources_of(url)` names them), disk to
    the others (`sources_of(url)` is None: no handle made on their GPUs exists), one after the other in one sync;
    the source stages again between them, since a streaming source gathers each bucket once per staging."""

    def __init__(self, ipc: IpcTransport, disk: Any, sources_of: Callable[[str], Sequence[int] | None]):
        self.ipc, self.disk, self.sources_of = ipc, disk, sources_of
        self.layouts = ipc.layouts

    def _split(self, urls: Sequence[str]) -> tuple[list[str], list[str]]:
        near = [url for url in urls if self.sources_of(url) is not None]
        return near, [url for url in urls if url not in near]

    def connect(self, urls: Sequence[str]) -> None:
        for transport, part in zip((self.ipc, self.disk), self._split(urls)):
            if part:
                transport.connect(part)

    def transfer(self, urls: Sequence[str], weight_version: str) -> Transfer:
        near, far = self._split(urls)
        done = self.ipc.transfer(near, weight_version) if near else None
        if not far:
            return done
        if done is not None:
            self.ipc.source.stage_weights(False)
        rest = self.disk.transfer(far, weight_version)
        if done is None:
            return rest
        done.engines.update(rest.engines)
        done.engine_seconds.update(rest.engine_seconds)
        for key, seconds in rest.timings.items():
            done.timings[key] = done.timings.get(key, 0.0) + seconds
        return done

    def disconnect(self, urls: Sequence[str]) -> list[str]:
        return []  # point to point on both sides: nothing per engine to undo

    def close(self) -> None:
        self.ipc.close()
        self.disk.close()
