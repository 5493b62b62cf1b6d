"""Who holds the devices in each phase of a step. The loop calls `before_rollout()` and `before_train()`, and a
trainer restart `before_trainer_restart()`; with `cluster.placement: colocated` trainer and engines share devices and
take turns (`Colocated`), otherwise both stay resident and nothing happens (`Disaggregated`)."""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from weight_sync.engine_calls import admin_key, post_json, run_together

# SGLang's memory tags (sglang.srt.constants GPU_MEMORY_TYPE_*), the `tags` of its memory-occupation requests.
WEIGHTS, KV_CACHE = "weights", "kv_cache"


class Colocation(Protocol):
    def before_rollout(self) -> None: ...
    def before_train(self) -> None: ...
    def sync(self, version: int) -> None: ...
    def metrics(self) -> dict[str, float]: ...
    def before_trainer_restart(self) -> None: ...


class OffloadableTrainer(Protocol):
    version: int

    def offload(self) -> int: ...
    def onload(self) -> int: ...


def sync_metrics(bridge: Any) -> dict[str, float]:
    """The last sync's figures as `sync/*` record keys: bytes, buckets, GB/s, seconds in total and split into
    stage / pack / wire / copy-in / verify (weight_sync.bridge.WeightBridge.last_sync); the syncs sent again after a
    failure, over the run, as `fault/sync_retries`."""
    last = dict(getattr(bridge, "last_sync", None) or {})
    retries = {"fault/sync_retries": float(last.pop("retries"))} if "retries" in last else {}
    return {**{f"sync/{key}": float(value) for key, value in last.items() if isinstance(value, (int, float))},
            **retries}


class Disaggregated:
    """Separate devices: trainer and engines keep their memory; weights are synced right after training."""

    def __init__(self, bridge: Any):
        self.bridge = bridge
        self._metrics: dict[str, float] = {}

    def before_rollout(self) -> None:
        pass

    def before_train(self) -> None:
        pass

    def before_trainer_restart(self) -> None:
        pass

    def sync(self, version: int) -> None:
        self.bridge.sync(version)
        self._metrics = sync_metrics(self.bridge)

    def metrics(self) -> dict[str, float]:
        """This step's sync figures (none on a step without a sync)."""
        out, self._metrics = self._metrics, {}
        return out


class Colocated:
    """Shared devices. Before rollout: engines take their weights memory back and receive the current weights
    (the trainer is still resident, so it is the bridge's source), then the trainer offloads and the engines take
    their KV cache back. Before training: engines release weights and KV cache, the trainer onloads. Before a trainer
    restart (a rank died, in whatever phase): engines release what they still hold, as before training, since the new
    ranks start resident; the restore's sync then brings the engines back with the checkpoint's weights.

    `sync(version)` after training only records the version: the engines hold no weights to update then, so the
    transfer happens in the next `before_rollout`, where a resumed engine needs it anyway. A sync while the engines
    hold their weights and the trainer is resident (a resumed run's first, before any phase) transfers at once:
    no `before_rollout` would, and the engines would generate with their start-up weights."""

    def __init__(self, *, trainer: OffloadableTrainer, bridge: Any, engine_urls: Sequence[str],
                 timeout_s: float = 300.0, api_key: str | None = None, admin_api_key: str | None = None):
        self.trainer, self.bridge, self.engine_urls, self.timeout_s = trainer, bridge, engine_urls, timeout_s
        self.api_key, self.admin_key = api_key, admin_key(api_key, admin_api_key)  # the engines' SGLang keys
        # memory tags the engines have given up: both or none, except after a death in before_rollout between
        # its two resumes
        self._released: set[str] = set()
        self._trainer_offloaded = False  # the trainer starts resident; before_rollout offloads it
        self._version: int | None = None
        self._metrics: dict[str, float] = {}

    def before_rollout(self) -> None:
        if self._released:
            self._resume(WEIGHTS)
            self.bridge.sync(self._version if self._version is not None else self.trainer.version)
            self._metrics.update(sync_metrics(self.bridge))
        self._metrics["colocation/trainer_bytes_in_rollout"] = float(self.trainer.offload())
        self._trainer_offloaded = True
        self._resume(KV_CACHE)
        self._record_engine_bytes("colocation/engine_weight_bytes_in_rollout")

    def before_train(self) -> None:
        self._release(KV_CACHE, WEIGHTS)
        self._record_engine_bytes("colocation/engine_weight_bytes_in_train")
        self._metrics["colocation/trainer_bytes_in_train"] = float(self.trainer.onload())
        self._trainer_offloaded = False

    def before_trainer_restart(self) -> None:
        """The trainer group is about to be started again: its new ranks load the model and optimizer onto the
        devices, so the engines give up whatever they still hold first (a rank may die in any phase, the engines
        generating, released, or between before_rollout's resumes). Afterwards the trainer is resident and the
        engines hold no weights: the next sync records its version and before_rollout brings the engines back."""
        self._release(KV_CACHE, WEIGHTS)
        self._trainer_offloaded = False
        self._version = None

    def sync(self, version: int) -> None:
        self._version = version
        if not self._released and not self._trainer_offloaded:
            self.bridge.sync(version)
            self._metrics.update(sync_metrics(self.bridge))

    def metrics(self) -> dict[str, float]:
        """Bytes each side held at the start of this step's phases (0 = released / offloaded), and the figures of
        the sync in this step's before_rollout."""
        out, self._metrics = self._metrics, {}
        return out

    def _release(self, *tags: str) -> None:
        """Release the tags the engines still hold (never one twice: SGLang's second weights release would stash the
        model's buffers again from memory already given up)."""
        held = [tag for tag in tags if tag not in self._released]
        if held:
            self._engines("/release_memory_occupation", held)
            self._released.update(held)

    def _resume(self, tag: str) -> None:
        """Resume `tag` if the engines gave it up (SGLang's scheduler fails on a tag it holds)."""
        if tag in self._released:
            self._engines("/resume_memory_occupation", [tag])
            self._released.discard(tag)

    def _engines(self, route: str, tags: list[str]) -> None:
        run_together([lambda u=url: post_json(f"{u}{route}", {"tags": tags}, self.timeout_s, self.admin_key)
                      for url in self.engine_urls], self.timeout_s)

    def _record_engine_bytes(self, key: str) -> None:
        """Engine weight bytes from `/get_server_info` where the engine reports them (the embedded engine does)."""
        states = [post_json(f"{u}/get_server_info", None, self.timeout_s, self.api_key).get("internal_states", [{}])[0]
                  for u in self.engine_urls]
        if all("weight_bytes" in s for s in states):
            self._metrics[key] = float(sum(s["weight_bytes"] for s in states))


def make_colocation(placement: str, *, trainer: Any, bridge: Any, engine_urls: Sequence[str],
                    timeout_s: float = 300.0, api_key: str | None = None,
                    admin_api_key: str | None = None) -> Colocation:
    """`cluster.placement` -> the component the loop calls around each phase (`api_key` / `admin_api_key`: the
    engines' SGLang keys, if they were started with them)."""
    if placement == "colocated":
        return Colocated(trainer=trainer, bridge=bridge, engine_urls=engine_urls, timeout_s=timeout_s,
                         api_key=api_key, admin_api_key=admin_api_key)
    if placement == "disaggregated":
        return Disaggregated(bridge)
    raise ValueError(f"cluster.placement must be 'colocated' or 'disaggregated', got {placement!r}")
