"""The parallel-sources transport: each pipeline stage, and with expert parallelism each expert group, sends its own
tensors from its own trainer rank through its own weight group (`sluice_w_s<k>_...`), side by side with the others.
SGLang 0.5.23 runs one weight update at a time per engine, in arrival order (its `FanOutCommunicator` queues them),
so every engine is handed the buckets of all sources in one interleaved order, one request at a time: the sources
gather and pack concurrently, an engine receives one bucket at a time, and no two engines wait on each other's groups.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence, TypeVar

from weight_sync.buckets import BucketLayout
from weight_sync.engine_calls import call_update, run_together
from weight_sync.transports import BroadcastTransport, Transfer, WeightSource


class RankView:
    """A `WeightSource` seen through one of its sending ranks (one parallel source): the channels it opens name the
    rank (`source` in the spec), and its weight group is hosted on that rank's node where the source can tell
    (`weight_channel_address(rank)`)."""

    def __init__(self, source: WeightSource, rank: int):
        self.source, self.rank = source, rank
        if hasattr(source, "weight_channel_address"):
            self.weight_channel_address = lambda: source.weight_channel_address(rank)

    def open_weight_channel(self, name: str, spec: dict[str, Any]) -> None:
        self.source.open_weight_channel(name, {**spec, "source": self.rank})

    def send_weight_bucket(self, channel: str, index: int) -> dict[str, Any]:
        return self.source.send_weight_bucket(channel, index)

    def prepare_weight_bucket(self, channel: str, index: int, delta: bool) -> dict[str, Any]:
        return self.source.prepare_weight_bucket(channel, index, delta)

    def close_weight_channel(self, name: str) -> None:
        self.source.close_weight_channel(name)


Part = TypeVar("Part")


def parallel_sources(mode: str | None, parts: Sequence[Part]) -> Sequence[Part] | None:
    """The sources the bridge sends from side by side, or None for one source (trainer rank 0 sends everything):
    `sync.sources` one, or a layout with a single source. `parts`: the layout's sources, in rank order."""
    return parts if mode != "one" and len(parts) > 1 else None


def source_group_prefix(k: int) -> str:
    """The name prefix of the `k`-th parallel source's weight groups (<prefix>_<driver pid>_<n>)."""
    return f"sluice_w_s{k}"


def interleave(counts: Sequence[int]) -> list[tuple[int, int]]:
    """(source, bucket) pairs, round robin over the sources: the order every engine receives buckets in."""
    return [(k, i) for i in range(max(counts, default=0)) for k, n in enumerate(counts) if i < n]


class ParallelBroadcastTransport:
    """One `BroadcastTransport` (its own weight group) per source, every engine in every group at `rank_offset +
    tp_rank`; a transfer runs every source's sends and every engine's requests at once. `parts`: (source rank, its
    bucket layouts) per source. `layouts`: every bucket in the order engines receive them (`interleave`)."""

    def __init__(self, source: WeightSource, parts: Sequence[tuple[int, list[BucketLayout]]], **broadcast: Any):
        self.parts = [BroadcastTransport(RankView(source, rank), layouts, group_prefix=source_group_prefix(k),
                                         **broadcast) for k, (rank, layouts) in enumerate(parts)]
        self.ranks = [rank for rank, _ in parts]
        self.order = interleave([len(layouts) for _, layouts in parts])
        self.layouts = [self.parts[k].layouts[i] for k, i in self.order]
        self.timeout_s, self.key = broadcast["timeout_s"], broadcast.get("key")

    @property
    def address(self) -> tuple[str, int] | None:
        """Where the first source's newest group is hosted (for logs)."""
        return self.parts[0].address

    def connect(self, urls: Sequence[str]) -> None:
        """One group per source, created one after the other (each engine joins each group in its own call)."""
        for part in self.parts:
            part.connect(urls)

    def transfer(self, urls: Sequence[str], weight_version: str, delta: bool | None = None) -> Transfer:
        """Every source sends its buckets in order while every engine takes the interleaved order, one request at a
        time; the last request carries `weight_version`. The first failure is raised at once: every group's abort
        key tells the members still inside a broadcast to leave, no further bucket starts, and every group is
        dropped (the next sync builds fresh ones). `delta` (delta sync; None: off): each source chooses a bucket's
        form before sending it (`BroadcastTransport.transfer`), and the engines' request for it waits for that."""
        for part in self.parts:
            if tuple(urls) not in part.groups:
                part.connect(urls)
        names = [part.groups[tuple(urls)] for part in self.parts]
        stop, sent, answers = threading.Event(), {}, {}
        prepared: dict[tuple[int, int], dict[str, Any]] = {}
        chosen = {key: threading.Event() for key in self.order}

        def send(k: int) -> None:
            for i in range(len(self.parts[k].layouts)):
                if stop.is_set():
                    return
                if delta is not None:
                    prepared[k, i] = self.parts[k].source.prepare_weight_bucket(names[k], i, delta)
                    chosen[k, i].set()
                sent[k, i] = self.parts[k].source.send_weight_bucket(names[k], i)

        def receive(url: str) -> None:
            for position, (k, i) in enumerate(self.order):
                if stop.is_set():
                    return
                payload = self._payload(self.parts[k].layouts[i], names[k], position, weight_version)
                if delta is not None:
                    while not chosen[k, i].wait(0.05):
                        if stop.is_set():
                            return
                    payload.update({key: prepared[k, i][key] for key in ("names", "dtypes", "shapes", "load_format")})
                answers[url, k, i] = call_update(url, "/update_weights_from_distributed", payload, self.timeout_s,
                                                 self.key)

        def on_failure() -> None:
            stop.set()
            for part, name in zip(self.parts, names):
                part._abort(name)

        calls = [lambda k=k: send(k) for k in range(len(self.parts))] + [lambda url=url: receive(url) for url in urls]
        try:
            run_together(calls, self.timeout_s, on_failure=on_failure)
        except Exception as err:
            if stop.is_set():  # members were told to leave a broadcast midway: the groups are spent
                for part in self.parts:
                    for problem in part._drop_group(tuple(urls)):
                        err.add_note(problem)
            raise
        result = Transfer(engines={url: [] for url in urls})
        for k, i in self.order:
            if delta is not None:
                result.add_prepared(prepared[k, i])
            result.add_source(sent[k, i])
            result.add_engines(urls, [answers[url, k, i] for url in urls], 1)
        return result

    def _payload(self, layout: BucketLayout, group_name: str, position: int, weight_version: str) -> dict[str, Any]:
        """SGLang's `/update_weights_from_distributed` body for one bucket; the last one in the engines' order
        carries the version and flushes the cache."""
        payload = {**layout.to_json(), "group_name": group_name, "load_format": "flattened_bucket",
                   "flush_cache": False, "abort_all_requests": False}
        del payload["offsets"]  # SGLang's struct has no such field; packing order defines them
        if position == len(self.order) - 1:
            payload.update(flush_cache=True, weight_version=weight_version)
        return payload

    def disconnect(self, urls: Sequence[str]) -> list[str]:
        return [problem for part in self.parts for problem in part.disconnect(urls)]

    def close(self) -> None:
        for part in self.parts:
            part.close()
