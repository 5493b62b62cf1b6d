"""The engine endpoints the bridge speaks, with SGLang's paths and request field names (io_struct.py): weight groups,
the three update routes (the last bucket's request carries `weight_version`), the version read-back and the weights
checker. Blocking HTTP; the bridge runs calls side by side.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight update, or its weights differ from the source's after one."""


def bearer(key: str | None) -> dict[str, str]:
    """SGLang's `Authorization: Bearer <key>` header; no header without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def admin_key(api_key: str | None, admin_api_key: str | None) -> str | None:
    """The key SGLang's admin routes (weights, memory, pause/continue, abort, flush) take: the admin key where the
    server has one, else its api key (which then guards every route)."""
    return admin_api_key or api_key


def post_json(url: str, payload: dict[str, Any] | None = None, timeout_s: float = 300.0,
              key: str | None = None) -> dict[str, Any]:
    """POST (or GET when payload is None) JSON to an engine, with `key` as bearer token when given; non-2xx
    answers raise with the body."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **bearer(key)})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read().decode()
    except urllib.error.HTTPError as err:
        raise WeightSyncError(f"{url} answered {err.code}: {err.read().decode()[:500]}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        raise WeightSyncError(f"{url} did not answer ({err}); is the engine still running?") from None
    return json.loads(body) if body else {}


def call_update(url: str, route: str, payload: dict[str, Any], timeout_s: float,
                key: str | None = None) -> dict[str, Any]:
    """POST an update route; an answer without `success: true` raises with the engine's message."""
    answer = post_json(f"{url}{route}", payload, timeout_s, key)
    if not answer.get("success", False):
        raise WeightSyncError(f"engine {url} failed {route}: {answer.get('message', answer)}")
    return answer


ABORT_GRACE_S = 30.0  # after a failure, how long the other calls get to leave (they were told to by `on_failure`)


def run_together(calls: Sequence[Callable[[], Any]], timeout_s: float, pool: ThreadPoolExecutor | None = None,
                 on_failure: Callable[[], None] | None = None) -> list[Any]:
    """Run blocking calls at the same time (collectives need every side inside); return their results in order
    once all have finished. The first call to fail is the cause: once it fails, `on_failure` tells the others to
    leave (e.g. the weight group's abort key), they get `ABORT_GRACE_S` to return, and that first failure is
    raised, not the timeouts it caused in the calls still waiting for the failed one."""
    own = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=max(len(calls), 1))
    try:
        futures = [pool.submit(call) for call in calls]
        done, pending = wait(futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed and pending and on_failure is not None:
            on_failure()
            wait(pending, timeout=ABORT_GRACE_S)
    finally:
        if own:
            pool.shutdown(wait=False)
    if failed:
        raise failed[0].exception()
    if pending:
        if on_failure is not None:
            on_failure()
        raise WeightSyncError(f"{len(pending)} of {len(calls)} weight-sync calls did not finish within {timeout_s:g} s")
    return [f.result() for f in futures]


def engine_capabilities(url: str, timeout_s: float, key: str | None = None) -> frozenset[str]:
    """What an engine offers beyond SGLang's API: sluice's embedded engine lists its extras (e.g.
    "bucket_checksums") under `sluice_capabilities` in `/get_server_info`; SGLang, and the embedded engine in
    `--sglang-strict` mode, list none."""
    return frozenset(post_json(f"{url}/get_server_info", None, timeout_s, key).get("sluice_capabilities") or ())


def begin_update_session(url: str, timeout_s: float, key: str | None = None) -> bool:
    """Open SGLang's weight-update session (`/begin_weight_update`): SGLang 0.5.23 refuses every
    `/update_weights_from_distributed` and `/update_weights_from_tensor` outside one. False for an engine without
    the route (an older server: nothing to open); an engine's refusal raises with its message."""
    try:
        call_update(url, "/begin_weight_update", {}, timeout_s, key)
    except WeightSyncError as err:
        if " answered 404" in str(err):
            return False
        raise
    return True


def end_update_session(url: str, timeout_s: float, key: str | None = None) -> None:
    """Close the session `begin_update_session` opened (`/end_weight_update`)."""
    call_update(url, "/end_weight_update", {}, timeout_s, key)


def answers_at_all(url: str, timeout_s: float, key: str | None = None) -> bool:
    """Whether the engine's HTTP server answers at all within `timeout_s` (any HTTP status is an answer); False for
    one that is gone or hangs. It asks GET /model_info, which SGLang answers at once, paused or not; not GET
    /health, which SGLang answers by generating a token (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, on by default),
    so a paused server answers it only after SGLANG_HEALTH_CHECK_TIMEOUT (20 s), with 503."""
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/model_info", headers=bearer(key)),
                                    timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def weight_version(url: str, timeout_s: float, key: str | None = None) -> str | None:
    """The engine's version, from `/model_info` (SGLang 0.5.23 reports `weight_version` there; an api-key route)."""
    reported = post_json(f"{url}/model_info", None, timeout_s, key).get("weight_version")
    return None if reported is None else str(reported)


def weight_checksums(url: str, timeout_s: float, key: str | None = None) -> dict[str, str]:
    """Per-tensor checksums of the engine's live weights, from SGLang's `/weights_checker` (action "checksum"; an
    admin route)."""
    answer = call_update(url, "/weights_checker", {"action": "checksum"}, timeout_s, key)
    ranks = answer.get("ranks") or []
    if len(ranks) != 1:
        raise WeightSyncError(f"engine {url}: /weights_checker reported {len(ranks)} ranks; the full comparison "
                              "handles TP=1 engines (use sync.verify: checksum for others)")
    return dict(ranks[0]["checksums"])
