"""The weight bridge: trainer weights -> buckets -> transport -> engines (the last bucket tags the version), then
verification. The controller pauses generation around `sync()`; `add_engine()` brings a late or restarted engine to
the current version before the fleet puts it behind the router.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Sequence

from weight_sync.buckets import DEFAULT_BUCKET_BYTES, BucketLayout, pipeline_bucket_bytes, plan_buckets, spec_bytes
from weight_sync.config import BridgeConfig
from weight_sync.engine_calls import (WeightSyncError, admin_key, answers_at_all, begin_update_session,
                                     end_update_session, engine_capabilities, post_json, run_together)
from weight_sync.ipc_transport import IpcOrDisk, IpcTransport
from weight_sync.parallel import ParallelBroadcastTransport, parallel_sources
from weight_sync.transports import BroadcastTransport, DiskTransport, Transport, WeightSource, free_port
from weight_sync.verify import check_bucket_checksums, check_full, check_versions

VERIFY_MODES = ("auto", "checksum", "full", "off")
SOURCE_MODES = (None, "one", "parallel")
BUCKET_CHECKSUMS = "bucket_checksums"  # the embedded engine's capability that verify checksum / full rest on
DELTA_SYNC = "delta_sync"  # the embedded engine's capability to apply delta buckets (weight_sync.delta)
HEALTH_TIMEOUT_S = 5.0  # after a failed sync, an engine that does not answer at all within this is faulty


class WeightBridge:
    """Moves the source's weights to every engine; `sync(version)` = transfer (tagged `version`) -> verify.
    `api_key` / `admin_api_key`: the engines' SGLang keys, when they were started with them. `pipeline`: buckets
    of the size that lets packing overlap the wire (`pipeline_bucket_bytes`, at most `bucket_bytes`); off: buckets
    of `bucket_bytes`, packed and sent one after the other. `sources`: "parallel" plans each source's buckets apart
    and sends them through a group per source (`weight_sync.parallel`; the source must offer `weight_source_plan`),
    "one" through one group from one rank, None: parallel when the source reports more than one. `delta` (broadcast
    only): after a confirmed sync to the whole fleet, each bucket goes as its changes since then where that is
    smaller (`weight_sync.delta`); the source must offer `prepare_weight_bucket`. `max_retries`: a sync that fails
    while every engine still answers (GET /model_info) is sent again this many times, each on weight groups built anew
    (`sync_retries` counts them); a fault of an engine (one that answers nothing) is raised at once, for the fleet
    watch to repair."""

    def __init__(self, source: WeightSource, engine_urls: Sequence[str], *, make_transport: Any,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify: str = "checksum", timeout_s: float = 300.0,
                 api_key: str | None = None, admin_api_key: str | None = None, pipeline: bool = True,
                 sources: str | None = None, delta: bool = False, max_retries: int = 2):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if sources not in SOURCE_MODES:
            raise ValueError(f"sources must be one of {SOURCE_MODES}, got {sources!r}")
        self.sources = sources  # one, parallel, or None: parallel when the source's layout has several
        self.source, self.engine_urls = source, list(engine_urls)
        self.bucket_bytes, self.verify, self.timeout_s = bucket_bytes, verify, timeout_s
        self.pipeline = pipeline
        self._make_transport = make_transport  # (source, layouts, with_checksum, pipeline, parts) -> Transport
        self.layouts: list[BucketLayout] = []
        self.transport: Transport | None = None
        self.version: int | None = None  # the last version every engine verifiably holds
        self.last_sync: dict[str, float] = {}
        self.left_behind = 0  # engines that could not leave a weight group (hung or gone), over the run
        self.max_retries, self.sync_retries = max_retries, 0  # syncs sent again after a failure, over the run
        self.api_key, self.admin_key = api_key, admin_key(api_key, admin_api_key)
        self.requested_verify = verify
        self.delta = delta
        # Delta sync: do the source's baselines hold exactly what every engine holds? Only after a sync to the whole
        # fleet that every engine confirmed; any failure, a new channel or a fleet change makes the next sync whole.
        self.delta_ready = False

    def connect(self) -> None:
        """Plan the buckets from the source's weight specs, settle the verification the engines allow
        (`_settle_verify`) and open the transport to every engine."""
        self.verify = self._settle_verify(self.engine_urls)
        self._check_delta(self.engine_urls)
        specs = self.source.hf_weight_specs()
        plan = self._source_plan()
        if plan is None:
            self.layouts = plan_buckets(specs, self._bucket_size(specs))
            self.transport = self._make_transport(self.source, self.layouts, self.verify != "off", self.pipeline)
        else:
            by_name = {spec[0]: spec for spec in specs}
            parts = [(rank, [by_name[n] for n in names]) for rank, names in plan]
            parts = [(rank, plan_buckets(part, self._bucket_size(part))) for rank, part in parts]
            self.transport = self._make_transport(self.source, [], self.verify != "off", self.pipeline, parts=parts)
            self.layouts = self.transport.layouts
        self.transport.connect(self.engine_urls)

    def _check_delta(self, urls: Sequence[str]) -> None:
        """Delta sync needs engines that apply delta buckets: sluice's embedded engine. SGLang 0.5.x hands
        `/update_weights_from_distributed` to the model's own loader whatever its `load_format` (a custom loader
        is reached only from `/update_weights_from_tensor`), so it is refused before any weight moves."""
        if not self.delta:
            return
        lacking = [url for url in urls if DELTA_SYNC not in engine_capabilities(url, self.timeout_s, self.api_key)]
        if lacking:
            raise WeightSyncError(
                f"sync.delta: true needs engines that apply delta buckets (sluice's embedded engine); {lacking[0]} "
                "does not (an SGLang server, or --sglang-strict: SGLang 0.5.x loads /update_weights_from_distributed "
                "through the model's own loader, see docs/weight_sync.md, 'Delta sync'): set sync.delta: false")

    def _bucket_size(self, specs: list) -> int:
        return pipeline_bucket_bytes(spec_bytes(specs), self.bucket_bytes) if self.pipeline else self.bucket_bytes

    def _source_plan(self) -> list[tuple[int, list[str]]] | None:
        """(source rank, HF names) per parallel source, or None for one source: `sources` one, a source that cannot
        split (`weight_source_plan` missing: refused when parallel was asked for), or a layout with one stage and
        one expert group."""
        if self.sources == "one":
            return None
        plan_of = getattr(self.source, "weight_source_plan", None)
        if plan_of is None:
            if self.sources == "parallel":
                raise ValueError("sync.sources: parallel needs a source with one rank per pipeline stage / expert "
                                 "group (the megatron-core trainer); this one has a single rank: use one")
            return None
        return parallel_sources(self.sources, plan_of())

    def _settle_verify(self, urls: Sequence[str]) -> str:
        """The verification to run with these engines, from what they say they offer (`engine_capabilities`),
        never assumed: bucket checksums and the HF-named weights checker are the embedded engine's; SGLang (and
        the embedded engine in strict mode) offers neither, so `auto` checks versions only there and `checksum` /
        `full` are refused before any weight moves."""
        lacking = [url for url in urls if BUCKET_CHECKSUMS not in engine_capabilities(url, self.timeout_s, self.api_key)]
        if self.requested_verify == "auto":
            return "off" if lacking else "checksum"
        if lacking and self.requested_verify != "off":
            raise WeightSyncError(
                f"sync.verify: {self.requested_verify} needs engines that report per-bucket checksums (sluice's "
                f"embedded engine); {lacking[0]} does not (an SGLang server, or --sglang-strict): use sync.verify: "
                "auto (versions are checked after every sync) or off")
        return self.requested_verify

    def sync(self, version: int) -> dict[str, float]:
        """Send the source's current weights to every engine tagged `version`, verify; returns the sync's metrics:
        seconds per phase (stage_s: gathering the weights, transfer_s, verify_s, total_s), bytes, buckets,
        gb_per_s (bytes / total_s), and where the transfer's time went, summed over buckets: pack_s (the source's
        copy into bucket buffers), wire_s (broadcasts, start to end), source_checksum_s and copy_in_s (the slowest
        engine's copy into its model plus its checksums). Pipelined, these overlap: together they exceed
        transfer_s by the time the pipeline saved."""
        for attempt in range(self.max_retries + 1):
            try:
                self._transfer_and_verify(self.engine_urls, str(version))
                break
            except Exception as err:
                if attempt == self.max_retries or not all(run_together(
                        [lambda url=url: answers_at_all(url, HEALTH_TIMEOUT_S, self.api_key) for url in self.engine_urls],
                        2 * HEALTH_TIMEOUT_S)):
                    raise
                self.sync_retries += 1
                print(f"sluice: the weight sync to version {version} failed ({(str(err).strip().splitlines() or [''])[0]}"
                      f"); every engine answers, so the weight groups are built anew and it goes again ({attempt + 1} of "
                      f"at most {self.max_retries} retries, sync.max_retries)", file=sys.stderr, flush=True)
                self._rebuild_channels()
        self.version = version
        return self.last_sync

    def _rebuild_channels(self) -> None:
        """Close the channel to the fleet (a group a failed transfer broke is already gone) and open a fresh one."""
        self._disconnect(self.engine_urls)
        self.delta_ready = False
        self.transport.connect(self.engine_urls)

    def add_engine(self, url: str) -> None:
        """Bring a new engine to the fleet's version on a channel of its own, then add it to every later sync
        (broadcast: the group is rebuilt with it, in list order). The source sends its live weights, so they are
        the fleet's only while the source is still at the last synced version; a source that trained since (its
        `version` differs: `sync.interval` > 1) brings the whole fleet, the new engine with it, to its own version
        instead (`sync`), so no engine runs newer weights under an older tag: the caller pauses generation then
        (`is_behind_source`)."""
        if self.transport is None:
            raise RuntimeError("WeightBridge.add_engine called before connect()")
        if url in self.engine_urls:
            raise ValueError(f"engine {url} is already synced by this bridge")
        if self.verify != "off" and self._settle_verify([url]) == "off":
            raise WeightSyncError(f"engine {url} reports no bucket checksums, but this bridge verifies them for the "
                                  "rest of the fleet; every engine of a run must be of one kind")
        self._check_delta([url])
        self.delta_ready = False  # the fleet's channel is rebuilt: its baselines start empty
        if self.version is not None and not self.is_behind_source():
            self.transport.connect([url])
            try:
                self._transfer_and_verify([url], str(self.version))
            finally:
                self._disconnect([url])
        self._disconnect(self.engine_urls)
        self.engine_urls.append(url)
        self.transport.connect(self.engine_urls)
        if self.version is not None and self.is_behind_source():
            self.sync(self.source.version)

    def is_behind_source(self) -> bool:
        """Has the source trained past the last synced version? (A source that reports no `version` is taken to
        hold the synced weights.)"""
        live = getattr(self.source, "version", None)
        return self.version is not None and live is not None and live != self.version

    def remove_engine(self, url: str, *also: str) -> None:
        """Stop syncing an engine (it left the fleet, or hangs), and the engines `also` (gone with it: a lost node's),
        in one go; the others' channel is rebuilt without them. An engine that does not answer is left behind, not
        waited for (`_disconnect`)."""
        gone = {url, *also} & set(self.engine_urls)
        if not gone or self.transport is None:
            return
        self._disconnect(self.engine_urls)
        self.delta_ready = False
        self.engine_urls = [u for u in self.engine_urls if u not in gone]
        if self.engine_urls:
            self.transport.connect(self.engine_urls)

    def _disconnect(self, urls: list[str]) -> None:
        """Close the channel to `urls`; the source's side always closes. Engines that could not leave their side (a
        hung or dead one keeps it until its own timeout or exit) are counted in `left_behind` (`sync/left_behind`
        in every sync's figures) and named on stderr."""
        problems = self.transport.disconnect(urls) or []
        self.left_behind += len(problems)
        for problem in problems:
            print(f"sluice: weight sync: {problem}", file=sys.stderr, flush=True)

    def _in_update_session(self, urls: list[str], transfer: Any) -> Any:
        """Run `transfer` inside SGLang's weight-update session on every engine (`/begin_weight_update` ...
        `/end_weight_update`): SGLang 0.5.23 refuses updates outside one. A refusal to open one surfaces before any
        weight moves; the sessions opened are closed whatever the transfer did (a failed transfer leaves the
        engines paused: the controller does not resume generation on partly written weights)."""
        opened: list[str] = []

        def begin(url: str) -> None:
            if begin_update_session(url, self.timeout_s, self.admin_key):
                opened.append(url)

        try:
            run_together([lambda url=url: begin(url) for url in urls], self.timeout_s)
            result = transfer()
        except Exception as err:
            for url in opened:  # the transfer's failure is the one raised; a session left open is noted on it
                try:
                    end_update_session(url, self.timeout_s, self.admin_key)
                except WeightSyncError as end_err:
                    err.add_note(f"and the update session on {url} could not be closed: {end_err}")
            raise
        run_together([lambda url=url: end_update_session(url, self.timeout_s, self.admin_key) for url in opened],
                     self.timeout_s)
        return result

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def reconnect(self, leave_out: Sequence[str] = ()) -> None:
        """The source was started again (a trainer restart): its side of every channel went with its processes.
        The engines leave theirs (`close`) and channels are opened afresh from the new source; the next sync goes
        whole (a new source holds no delta baselines). Engines in `leave_out` (dead, or answering nothing: the
        watch replaces them) get none; a replacement joins through `add_engine`."""
        self.close()
        self.engine_urls = [url for url in self.engine_urls if url not in leave_out]
        self.delta_ready = False
        self.connect()

    def _transfer_and_verify(self, urls: list[str], version: str) -> None:
        assert self.transport is not None, "WeightBridge used before connect()"
        t0 = time.perf_counter()
        tensor_sums = self.source.stage_weights(self.verify == "full")
        t1 = time.perf_counter()
        whole_fleet = list(urls) == self.engine_urls
        if self.delta:
            delta, self.delta_ready = self.delta_ready and whole_fleet, False
            transfer = self._in_update_session(urls, lambda: self.transport.transfer(urls, version, delta=delta))
        else:
            transfer = self._in_update_session(urls, lambda: self.transport.transfer(urls, version))
        t2 = time.perf_counter()
        if self.verify != "off":
            check_bucket_checksums(transfer, [b.names for b in self.layouts])
        # The version travels with the last bucket and lands with it (SGLang's update routes take `weight_version`);
        # no separate /update_weight_version, which would leave a window of new weights under the old tag.
        check_versions(urls, version, self.timeout_s, self.api_key)
        if self.verify == "full":
            tensor_sums = tensor_sums if tensor_sums is not None else transfer.tensor_sums
            run_together([lambda url=url: check_full(url, tensor_sums, self.timeout_s, self.admin_key) for url in urls],
                         self.timeout_s)
        t3 = time.perf_counter()
        self.delta_ready = self.delta and whole_fleet  # every engine confirmed: the baselines are what they hold
        nbytes = float(sum(b.nbytes for b in self.layouts))
        phases = {"pack_s": 0.0, "wire_s": 0.0, "source_checksum_s": 0.0, "copy_in_s": 0.0, **transfer.timings}
        self.last_sync = {"stage_s": t1 - t0, "transfer_s": t2 - t1, "verify_s": t3 - t2, "total_s": t3 - t0,
                          "bytes": nbytes, "buckets": float(len(self.layouts)), "gb_per_s": nbytes / (t3 - t0) / 1e9,
                          "left_behind": float(self.left_behind), "retries": float(self.sync_retries),
                          **phases, **self._byte_figures(transfer, nbytes)}

    def _byte_figures(self, transfer: Any, nbytes: float) -> dict[str, float]:
        """bytes_sent (on the wire) and bytes_full (what a whole sync sends); with delta sync also
        delta_changed_frac (elements that changed since the last sync, of all; 1 for a whole sync)."""
        if not self.delta:
            return {"bytes_sent": nbytes, "bytes_full": nbytes}
        figures = transfer.delta
        return {"bytes_sent": figures.get("bytes_sent", 0.0), "bytes_full": nbytes,
                "delta_changed_frac": figures.get("changed", 0.0) / max(figures.get("elements", 0.0), 1.0)}


def make_bridge(cfg: BridgeConfig, *, source: WeightSource, engine_urls: Sequence[str],
                disk_dir: str | None = None, engine_tp_size: int = 1, api_key: str | None = None,
                admin_api_key: str | None = None, pipeline: bool | None = None,
                ipc_sources: Callable[[str], Sequence[int] | None] | None = None) -> WeightBridge:
    """The bridge `cfg` (the `sync:` section, validated when it was built) describes, connected to every engine;
    each engine has `engine_tp_size` tensor-parallel ranks (SGLang's --tp-size) and was started with `api_key` /
    `admin_api_key` (SGLang's --api-key / --admin-api-key), if any. `pipeline`: see `WeightBridge`; None:
    `cfg.pipeline`, whose null means on with nccl and off with gloo. `cfg.sources` (broadcast only): one source
    rank, or parallel sources (weight_sync.parallel); null: parallel when the source reports several. `disk_dir`:
    where the disk transport writes when `cfg.disk_dir` is null. `ipc_sources(url)` (ipc): the trainer rank on the GPU
    of each of that engine's TP ranks (`IpcTransport`), or None for an engine on GPUs without one, which gets the
    weights by disk (`IpcOrDisk`); no mapping: rank 0 serves every rank."""
    if pipeline is None:
        pipeline = cfg.backend == "nccl" if cfg.pipeline is None else cfg.pipeline
    pipeline = pipeline and not cfg.delta  # a delta bucket is chosen just before it is sent: nothing is packed ahead
    options = dict(timeout_s=cfg.timeout_s, key=admin_key(api_key, admin_api_key))  # every weight route is admin
    transport = cfg.chosen_transport(colocated_sglang=False)  # launch.plan.run_plan has chosen it for a run
    if transport == "ipc":
        options["sources_of"] = ipc_sources
    make = TRANSPORT_MAKERS[transport](cfg, options, engine_tp_size, disk_dir)
    bridge = WeightBridge(source, engine_urls, make_transport=make, bucket_bytes=cfg.bucket_bytes, verify=cfg.verify,
                          timeout_s=cfg.timeout_s, api_key=api_key, admin_api_key=admin_api_key, pipeline=pipeline,
                          sources=cfg.sources if transport == "broadcast" else "one", delta=cfg.delta,
                          max_retries=cfg.max_retries)
    bridge.connect()
    return bridge


def _broadcast_maker(cfg: BridgeConfig, options: dict[str, Any], engine_tp_size: int, disk_dir: str | None) -> Any:
    """(source, layouts, with_checksum, pipeline, parts) -> a broadcast transport, parallel when `parts` is given."""
    def make(src, layouts, with_checksum, pipeline, parts=None):
        broadcast = dict(backend=cfg.backend, master_address=cfg.master_address, with_checksum=with_checksum,
                         ranks_per_engine=engine_tp_size, pipeline=pipeline, **options)
        if parts is not None:
            return ParallelBroadcastTransport(src, parts, **broadcast)
        return BroadcastTransport(src, layouts, **broadcast)
    return make


def _ipc_maker(cfg: BridgeConfig, options: dict[str, Any], engine_tp_size: int, disk_dir: str | None) -> Any:
    """ipc; with a source mapping, by disk to the engines it gives no sources (GPUs without a trainer rank)."""
    def make(src, layouts, with_checksum, pipeline):
        ipc = IpcTransport(src, layouts, with_checksum=with_checksum, pipeline=pipeline,
                           ranks_per_engine=engine_tp_size, **options)
        sources_of = options.get("sources_of")
        if sources_of is None:
            return ipc
        disk_options = {k: v for k, v in options.items() if k != "sources_of"}
        disk = DiskTransport(src, layouts, directory=cfg.disk_dir or disk_dir, with_checksum=with_checksum,
                             **disk_options)
        return IpcOrDisk(ipc, disk, sources_of)
    return make


def _disk_maker(cfg: BridgeConfig, options: dict[str, Any], engine_tp_size: int, disk_dir: str | None) -> Any:
    def make(src, layouts, with_checksum, pipeline):
        return DiskTransport(src, layouts, directory=cfg.disk_dir or disk_dir, with_checksum=with_checksum, **options)
    return make


# `sync.transport` -> what builds its transport for the bridge (BridgeConfig has refused any other value)
TRANSPORT_MAKERS = {"broadcast": _broadcast_maker, "ipc": _ipc_maker, "disk": _disk_maker}


__all__ = ["WeightBridge", "WeightSyncError", "make_bridge", "free_port", "post_json"]
