"""The weight bridge: trainer weights -> buckets -> transport -> engines (the last bucket tags the version), then
verification. The controller pauses generation around `sync()`; `add_engine()` brings a late or restarted engine to
the current version before the fleet puts it behind the router.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from weight_sync.buckets import DEFAULT_BUCKET_BYTES, BucketLayout, pipeline_bucket_bytes, plan_buckets, spec_bytes
from weight_sync.engine_calls import WeightSyncError, admin_key, post_json, run_together
from weight_sync.transports import (BroadcastTransport, DiskTransport, IpcTransport, Transport, WeightSource,
                                    free_port)
from weight_sync.verify import check_bucket_checksums, check_full, check_versions

VERIFY_MODES = ("checksum", "full", "off")


class WeightBridge:
    """Moves the source's weights to every engine; `sync(version)` = transfer (tagged `version`) -> verify.
    `api_key` / `admin_api_key`: the engines' SGLang keys, when they were started with them. `pipeline`: buckets
    of the size that lets packing overlap the wire (`pipeline_bucket_bytes`, at most `bucket_bytes`); off: buckets
    of `bucket_bytes`, packed and sent one after the other."""

    def __init__(self, source: WeightSource, engine_urls: Sequence[str], *, make_transport: Any,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify: str = "checksum", timeout_s: float = 300.0,
                 api_key: str | None = None, admin_api_key: str | None = None, pipeline: bool = True):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.source, self.engine_urls = source, list(engine_urls)
        self.bucket_bytes, self.verify, self.timeout_s = bucket_bytes, verify, timeout_s
        self.pipeline = pipeline
        self._make_transport = make_transport  # (source, layouts, with_checksum, pipeline) -> Transport
        self.layouts: list[BucketLayout] = []
        self.transport: Transport | None = None
        self.version: int | None = None  # the last version every engine verifiably holds
        self.last_sync: dict[str, float] = {}
        self.api_key, self.admin_key = api_key, admin_key(api_key, admin_api_key)

    def connect(self) -> None:
        """Plan the buckets from the source's weight specs and open the transport to every engine."""
        specs = self.source.hf_weight_specs()
        size = pipeline_bucket_bytes(spec_bytes(specs), self.bucket_bytes) if self.pipeline else self.bucket_bytes
        self.layouts = plan_buckets(specs, size)
        self.transport = self._make_transport(self.source, self.layouts, self.verify != "off", self.pipeline)
        self.transport.connect(self.engine_urls)

    def sync(self, version: int) -> dict[str, float]:
        """Send the source's current weights to every engine tagged `version`, verify; returns the sync's metrics:
        seconds per phase (stage_s: gathering the weights, transfer_s, verify_s, total_s), bytes, buckets,
        gb_per_s (bytes / total_s), and where the transfer's time went, summed over buckets: pack_s (the source's
        copy into bucket buffers), wire_s (broadcasts, start to end), source_checksum_s and copy_in_s (the slowest
        engine's copy into its model plus its checksums). Pipelined, these overlap: together they exceed
        transfer_s by the time the pipeline saved."""
        self._transfer_and_verify(self.engine_urls, str(version))
        self.version = version
        return self.last_sync

    def add_engine(self, url: str) -> None:
        """Bring a new engine to the current version on a channel of its own, then add it to every later sync
        (broadcast: the group is rebuilt with it, in list order)."""
        if self.transport is None:
            raise RuntimeError("WeightBridge.add_engine called before connect()")
        if url in self.engine_urls:
            raise ValueError(f"engine {url} is already synced by this bridge")
        if self.version is not None:
            self.transport.connect([url])
            try:
                self._transfer_and_verify([url], str(self.version))
            finally:
                self.transport.disconnect([url])
        self.transport.disconnect(self.engine_urls)
        self.engine_urls.append(url)
        self.transport.connect(self.engine_urls)

    def remove_engine(self, url: str) -> None:
        """Stop syncing an engine (it left the fleet); the others' channel is rebuilt without it."""
        if url not in self.engine_urls or self.transport is None:
            return
        others = [u for u in self.engine_urls if u != url]
        try:
            self.transport.disconnect(self.engine_urls)
        except WeightSyncError:
            pass  # the engine may be gone already: the source side of the channel is closed regardless
        self.engine_urls = others
        if others:
            self.transport.connect(others)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def _transfer_and_verify(self, urls: list[str], version: str) -> None:
        assert self.transport is not None, "WeightBridge used before connect()"
        t0 = time.perf_counter()
        tensor_sums = self.source.stage_weights(self.verify == "full")
        t1 = time.perf_counter()
        transfer = self.transport.transfer(urls, version)
        t2 = time.perf_counter()
        if self.verify != "off":
            check_bucket_checksums(transfer, [b.names for b in self.layouts])
        # The version travels with the last bucket and lands with it (SGLang's update routes take `weight_version`);
        # no separate /update_weight_version, which would leave a window of new weights under the old tag.
        check_versions(urls, version, self.timeout_s, self.api_key)
        if self.verify == "full":
            run_together([lambda url=url: check_full(url, tensor_sums, self.timeout_s, self.admin_key) for url in urls],
                         self.timeout_s)
        t3 = time.perf_counter()
        nbytes = float(sum(b.nbytes for b in self.layouts))
        phases = {"pack_s": 0.0, "wire_s": 0.0, "source_checksum_s": 0.0, "copy_in_s": 0.0, **transfer.timings}
        self.last_sync = {"stage_s": t1 - t0, "transfer_s": t2 - t1, "verify_s": t3 - t2, "total_s": t3 - t0,
                          "bytes": nbytes, "buckets": float(len(self.layouts)), "gb_per_s": nbytes / (t3 - t0) / 1e9,
                          **phases}


def make_bridge(sync_cfg: Any, *, source: WeightSource, engine_urls: Sequence[str],
                disk_dir: str | None = None, engine_tp_size: int = 1, api_key: str | None = None,
                admin_api_key: str | None = None, pipeline: bool | None = None) -> WeightBridge:
    """The bridge `sync_cfg` (glue.config.SyncConfig: transport, backend, bucket_bytes, verify, ...) describes,
    connected to every engine; each engine has `engine_tp_size` tensor-parallel ranks (SGLang's --tp-size) and
    was started with `api_key` / `admin_api_key` (SGLang's --api-key / --admin-api-key), if any. `pipeline`: see
    `WeightBridge`; None: `sync_cfg.pipeline`, whose null means on with nccl and off with gloo."""
    transport, timeout_s = sync_cfg.transport, sync_cfg.timeout_s
    if pipeline is None:
        pipeline = getattr(sync_cfg, "pipeline", None)
        pipeline = sync_cfg.backend == "nccl" if pipeline is None else pipeline
    key = admin_key(api_key, admin_api_key)  # every weight route is an admin route
    if transport == "broadcast":
        def make(src, layouts, with_checksum, pipeline):
            return BroadcastTransport(src, layouts, backend=sync_cfg.backend, master_address=sync_cfg.master_address,
                                      with_checksum=with_checksum, timeout_s=timeout_s,
                                      ranks_per_engine=engine_tp_size, key=key, pipeline=pipeline)
    elif transport == "ipc":
        def make(src, layouts, with_checksum, pipeline):
            return IpcTransport(src, layouts, device="cuda" if sync_cfg.backend == "nccl" else "cpu",
                                with_checksum=with_checksum, timeout_s=timeout_s, key=key, pipeline=pipeline)
    elif transport == "disk":
        def make(src, layouts, with_checksum, pipeline):
            return DiskTransport(src, layouts, directory=getattr(sync_cfg, "disk_dir", None) or disk_dir,
                                 with_checksum=with_checksum, timeout_s=timeout_s, key=key)
    else:
        raise ValueError(f"sync.transport must be 'broadcast', 'ipc' or 'disk', got {transport!r}")
    bridge = WeightBridge(source, engine_urls, make_transport=make, bucket_bytes=sync_cfg.bucket_bytes,
                          verify=sync_cfg.verify, timeout_s=timeout_s, api_key=api_key, admin_api_key=admin_api_key,
                          pipeline=pipeline)
    bridge.connect()
    return bridge


__all__ = ["WeightBridge", "WeightSyncError", "make_bridge", "free_port", "post_json"]
