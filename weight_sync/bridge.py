"""The weight bridge's driver side (first form): a trainer-side weight source and every engine join one process
group through SGLang's `/init_weights_update_group`; each sync broadcasts the HF-named tensors while the engines
receive them through `/update_weights_from_distributed`, then the engines' reported version is checked."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol


class WeightSource(Protocol):
    """The trainer as the bridge sees it (blocking calls; the bridge runs them beside the engines' HTTP calls)."""

    def hf_weight_specs(self) -> list[tuple[str, str, tuple[int, ...]]]: ...
    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str) -> None: ...
    def send_weights(self, group_name: str) -> None: ...


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight update, or reports a version other than the one sent."""


def post_json(url: str, payload: dict[str, Any] | None = None, timeout_s: float = 300.0) -> dict[str, Any]:
    """POST (or GET when payload is None) JSON to an engine; non-2xx answers raise with the body."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read().decode()
    except urllib.error.HTTPError as err:
        raise WeightSyncError(f"{url} answered {err.code}: {err.read().decode()[:500]}") from None
    return json.loads(body) if body else {}


class BroadcastBridge:
    """One group `[source rank 0, engine 0, engine 1, ...]`; every engine is a TP=1 server (rank_offset = 1 + i)."""

    def __init__(self, source: WeightSource, engine_urls: list[str], *, master_address: str, master_port: int,
                 backend: str = "gloo", group_name: str = "sluice_weights", timeout_s: float = 300.0):
        self.source, self.engine_urls = source, list(engine_urls)
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.group_name, self.timeout_s = backend, group_name, timeout_s
        self._specs: list[tuple[str, str, tuple[int, ...]]] | None = None

    def connect(self) -> None:
        """Create the group: the source and every engine join at the same time (each side blocks until all have)."""
        world_size = 1 + len(self.engine_urls)
        engine_calls = [
            (lambda url=url, rank=i + 1: self._check(url, post_json(f"{url}/init_weights_update_group", {
                "master_address": self.master_address, "master_port": self.master_port, "rank_offset": rank,
                "world_size": world_size, "group_name": self.group_name, "backend": self.backend,
            }, self.timeout_s)))
            for i, url in enumerate(self.engine_urls)
        ]
        source_call = lambda: self.source.join_weight_group(  # noqa: E731
            self.master_address, self.master_port, world_size, self.group_name, self.backend)
        self._run_together([source_call, *engine_calls])
        self._specs = self.source.hf_weight_specs()

    def sync(self, version: int) -> None:
        """Broadcast the source's weights to every engine and tag them `version`; verify each engine reports it
        (through `/model_info`, where SGLang 0.5.23 reports `weight_version`; `/get_weight_version` is gone there)."""
        assert self._specs is not None, "BroadcastBridge.sync called before connect()"
        names, dtypes, shapes = zip(*self._specs)
        payload = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                   "group_name": self.group_name, "flush_cache": True, "weight_version": str(version)}
        engine_calls = [
            (lambda url=url: self._check(url, post_json(f"{url}/update_weights_from_distributed", payload, self.timeout_s)))
            for url in self.engine_urls
        ]
        self._run_together([lambda: self.source.send_weights(self.group_name), *engine_calls])
        for url in self.engine_urls:
            reported = post_json(f"{url}/model_info", None, self.timeout_s).get("weight_version")
            if str(reported) != str(version):
                raise WeightSyncError(f"engine {url} reports weight_version {reported!r} after a sync to {version}")

    @staticmethod
    def _check(url: str, answer: dict[str, Any]) -> None:
        if not answer.get("success", False):
            raise WeightSyncError(f"engine {url} failed the weight update: {answer.get('message', answer)}")

    def _run_together(self, calls: list[Callable[[], None]]) -> None:
        """Run blocking calls concurrently; re-raise the first failure after all have returned or failed."""
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            futures = [pool.submit(call) for call in calls]
            errors = [f.exception(timeout=self.timeout_s) for f in futures]
        for err in errors:
            if err is not None:
                raise err
