"""SGLang's --api-key / --admin-api-key on the embedded engine, for real: the key each route needs matches SGLang's
own auth levels and decision function (read from the installed sglang source), keyed engines refuse what SGLang
refuses, and a whole fleet (engines, the real sgl-router, the client, the weight bridge) works with keys set."""
from __future__ import annotations

import ast
import asyncio
import http.client
import importlib.util
import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from glue.embedded_engine.auth import presents_key, required_key
from helpers.engines import call
from glue.embedded_engine.routes import ROUTES

API_KEY, ADMIN_KEY = "-sluice-api-key-1", "-sluice-admin-key-2"  # a leading "-" once broke the command line
GREEDY = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}}


def send(url: str, path: str, body: dict | None = None, *, key: str | None = None, method: str | None = None,
         authorization: str | None = None) -> tuple[int, object]:
    """(status, parsed JSON or text) of one call; `key` sends `Authorization: Bearer <key>`."""
    headers = {}
    if key is not None or authorization is not None:
        headers["Authorization"] = authorization if authorization is not None else f"Bearer {key}"
    return call(url, path, body, method=method, headers=headers)


# ---------------------------------------------------------------- the rules, against SGLang's source
@pytest.fixture(scope="module")
def sglang_srt() -> Path:
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it (it needs CUDA kernels)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (`pip install --no-deps sglang` provides the source these tests read)")
    return Path(next(iter(spec.submodule_search_locations))) / "srt"


def sglang_auth_levels(http_server: Path) -> dict[str, str]:
    """path -> the AuthLevel member SGLang's http_server.py marks its endpoint with ("NORMAL" when unmarked)."""
    levels: dict[str, str] = {}
    for node in ast.walk(ast.parse(http_server.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths, level = [], "NORMAL"
        for deco in node.decorator_list:
            if not isinstance(deco, ast.Call) or not isinstance(deco.func, (ast.Attribute, ast.Name)):
                continue
            name = deco.func.attr if isinstance(deco.func, ast.Attribute) else deco.func.id
            if name in ("get", "post", "put", "api_route") and deco.args and isinstance(deco.args[0], ast.Constant):
                paths.append(deco.args[0].value)
            elif name == "auth_level":
                level = deco.args[0].attr
        levels.update({p: level for p in paths})
    return levels


def test_every_route_sglang_also_serves_is_admin_exactly_where_sglang_marks_it_admin(sglang_srt):
    levels = sglang_auth_levels(sglang_srt / "entrypoints" / "http_server.py")
    assert levels.get("/update_weights_from_distributed") == "ADMIN_OPTIONAL"  # the parse found the markers
    shared = [r for r in ROUTES if r.path in levels]
    assert len(shared) >= 20
    mismatched = {r.path: levels[r.path] for r in shared if r.is_admin != (levels[r.path] == "ADMIN_OPTIONAL")}
    assert mismatched == {}
    own = {r.path for r in ROUTES} - set(levels)  # sluice's additions: read-only version probes
    assert own == {"/get_weight_version", "/weight_version"}
    assert not any(r.is_admin for r in ROUTES if r.path in own)


def load_sglang_auth(sglang_srt: Path):
    """sglang/srt/utils/auth.py on its own (it imports only the standard library at module level)."""
    spec = importlib.util.spec_from_file_location("sglang_auth_under_test", sglang_srt / "utils" / "auth.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_key_check_decides_like_sglangs_decide_request_auth_in_every_case(sglang_srt):
    sglang = load_sglang_auth(sglang_srt)
    headers = [None, "", "Bearer", "Bearer ", f"Bearer {API_KEY}", f"bearer {API_KEY}", f"BEARER {ADMIN_KEY}",
               f"Bearer {ADMIN_KEY}", f"Bearer  {API_KEY}", f"Basic {API_KEY}", API_KEY, f"Bearer {API_KEY}x"]
    cases = 0
    for api_key in (None, "", API_KEY):
        for admin_api_key in (None, "", ADMIN_KEY):
            for method, path in [("GET", "/health"), ("GET", "/health_generate"), ("POST", "/generate"),
                                 ("POST", "/pause_generation"), ("GET", "/no_such_route"), ("OPTIONS", "/generate"),
                                 ("GET", "/metrics"), ("POST", "/update_weights_from_tensor")]:
                is_admin = path in {r.path for r in ROUTES if r.is_admin}
                for header in headers:
                    theirs = sglang.decide_request_auth(
                        method=method, path=path, authorization_header=header, api_key=api_key,
                        admin_api_key=admin_api_key,
                        auth_level=sglang.AuthLevel.ADMIN_OPTIONAL if is_admin else sglang.AuthLevel.NORMAL)
                    key = required_key(method=method, path=path, is_admin_route=is_admin, api_key=api_key,
                                       admin_api_key=admin_api_key)
                    ours = key is None or presents_key(header, key)
                    assert ours == theirs.allowed, (api_key, admin_api_key, method, path, header)
                    cases += 1
    assert cases == 3 * 3 * 8 * len(headers)


def test_a_non_ascii_token_is_refused_where_sglang_raises(sglang_srt):
    sglang = load_sglang_auth(sglang_srt)
    with pytest.raises(TypeError):  # secrets.compare_digest on str: SGLang answers such a header with a 500
        sglang.decide_request_auth(method="POST", path="/generate", authorization_header="Bearer \xff",
                                   api_key=API_KEY, admin_api_key=None, auth_level=sglang.AuthLevel.NORMAL)
    assert not presents_key("Bearer \xff", API_KEY)
    assert not presents_key("Bearer \udcff", API_KEY)  # a lone surrogate cannot be encoded as UTF-8
    assert presents_key("Bearer cl\xe9", "cl\xe9")


# ---------------------------------------------------------------- engines started with keys
@pytest.fixture(scope="module")
def keyed_engine(engine_processes, tiny_model_dir) -> str:
    return engine_processes.start(tiny_model_dir, f"--api-key={API_KEY}", f"--admin-api-key={ADMIN_KEY}")


@pytest.fixture(scope="module")
def api_key_only_engine(engine_processes, tiny_model_dir) -> str:
    return engine_processes.start(tiny_model_dir, f"--api-key={API_KEY}")


@pytest.fixture(scope="module")
def admin_key_only_engine(engine_processes, tiny_model_dir) -> str:
    return engine_processes.start(tiny_model_dir, f"--admin-api-key={ADMIN_KEY}")


def test_generation_needs_the_api_key_and_the_admin_key_does_not_open_it(keyed_engine):
    assert send(keyed_engine, "/generate", GREEDY) == (401, {"error": "Unauthorized"})
    assert send(keyed_engine, "/generate", GREEDY, key="wrong")[0] == 401
    assert send(keyed_engine, "/generate", GREEDY, key=ADMIN_KEY)[0] == 401  # SGLang: admin key is not the api key
    assert send(keyed_engine, "/generate", GREEDY, authorization=f"Basic {API_KEY}")[0] == 401
    status, out = send(keyed_engine, "/generate", GREEDY, key=API_KEY)
    assert status == 200 and len(out["output_ids"]) == 2
    assert send(keyed_engine, "/generate", GREEDY, authorization=f"bearer {API_KEY}")[0] == 200  # scheme: any case
    for path in ("/model_info", "/get_server_info", "/get_weight_version"):
        assert send(keyed_engine, path)[0] == 401
        assert send(keyed_engine, path, key=API_KEY)[0] == 200


def test_health_stays_open_and_unknown_routes_need_the_api_key(keyed_engine):
    assert send(keyed_engine, "/health")[0] == 200
    assert send(keyed_engine, "/health_generate")[0] == 200
    assert send(keyed_engine, "/no_such_route")[0] == 401  # as SGLang: the key is checked before routing
    assert send(keyed_engine, "/no_such_route", key=API_KEY)[0] == 404


def test_every_admin_route_refuses_no_key_and_the_api_key_and_lets_the_admin_key_through(keyed_engine):
    admin = [r for r in ROUTES if r.is_admin]
    assert {"/update_weights_from_distributed", "/release_memory_occupation", "/pause_generation",
            "/continue_generation", "/abort_request", "/flush_cache"} <= {r.path for r in admin}
    for route in admin:
        reads_body = route.body is not None and route.method != "GET"
        body = {} if not reads_body else {"mode": 7, "tags": 7, "new_version": 7, "rid": 7, "names": 7,
                                                   "model_path": 7, "master_port": "x", "action": 7,
                                                   "serialized_named_tensors": 7, "group_name": 7,
                                                   "torch_empty_cache": "x", "selector": 7}
        for key in (None, API_KEY, "wrong"):
            status, answer = send(keyed_engine, route.path, body, key=key, method=route.method)
            assert (status, answer) == (401, {"error": "Unauthorized"}), (route, key)
        # through the gate with the admin key: the (deliberately bad) body is what gets refused; the rest succeed
        status, answer = send(keyed_engine, route.path, body, key=ADMIN_KEY, method=route.method)
        assert (status == 400 and answer["success"] is False) if reads_body else status == 200, (route, answer)


def test_admin_calls_with_the_admin_key_succeed(keyed_engine):
    assert send(keyed_engine, "/pause_generation", {"mode": "abort"}, key=ADMIN_KEY)[0] == 200
    assert send(keyed_engine, "/continue_generation", {}, key=ADMIN_KEY)[0] == 200
    assert send(keyed_engine, "/flush_cache", {}, key=ADMIN_KEY)[0] == 200
    assert send(keyed_engine, "/abort_request", {"abort_all": True}, key=ADMIN_KEY)[0] == 200
    status, answer = send(keyed_engine, "/weights_checker", {"action": "checksum"}, key=ADMIN_KEY)
    assert status == 200 and answer["success"] is True
    assert send(keyed_engine, "/generate", GREEDY, key=API_KEY)[0] == 200  # and generation goes on


def test_a_path_that_only_looks_like_health_does_not_skip_the_key(keyed_engine):
    host = urlsplit(keyed_engine)
    for raw_path in ("/health/../pause_generation", "/health/%2e%2e/pause_generation", "/./pause_generation",
                     "//pause_generation", "/pause_generation?x=/health"):
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
        try:
            conn.request("POST", raw_path, body=b'{"mode": "abort"}', headers={"Content-Type": "application/json"})
            status = conn.getresponse().status
        finally:
            conn.close()
        assert status in (401, 404), (raw_path, status)
    status, info = send(keyed_engine, "/get_server_info", key=API_KEY)
    assert status == 200 and info["internal_states"][0]["is_paused"] is False


def test_a_header_of_raw_non_utf8_bytes_is_refused_not_a_server_error(keyed_engine):
    host = urlsplit(keyed_engine)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
    try:
        conn.putrequest("POST", "/generate")
        conn.putheader("Authorization", b"Bearer \xff\xfe" + API_KEY.encode())
        conn.putheader("Content-Type", "application/json")
        body = json.dumps(GREEDY).encode()
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        assert conn.getresponse().status == 401
    finally:
        conn.close()
    assert send(keyed_engine, "/generate", GREEDY, key=API_KEY)[0] == 200


def test_with_only_an_api_key_admin_routes_take_the_api_key(api_key_only_engine):
    assert send(api_key_only_engine, "/flush_cache", {})[0] == 401
    assert send(api_key_only_engine, "/flush_cache", {}, key=API_KEY)[0] == 200
    assert send(api_key_only_engine, "/generate", GREEDY)[0] == 401
    assert send(api_key_only_engine, "/generate", GREEDY, key=API_KEY)[0] == 200


def test_with_only_an_admin_key_generation_is_open_and_admin_routes_need_the_admin_key(admin_key_only_engine):
    assert send(admin_key_only_engine, "/generate", GREEDY)[0] == 200
    assert send(admin_key_only_engine, "/model_info")[0] == 200
    assert send(admin_key_only_engine, "/flush_cache", {})[0] == 401
    assert send(admin_key_only_engine, "/flush_cache", {}, key="anything-else")[0] == 401
    assert send(admin_key_only_engine, "/flush_cache", {}, key=ADMIN_KEY)[0] == 200


# ---------------------------------------------------------------- the fleet, the router and the bridge with keys
@pytest.fixture(scope="module")
def keyed_fleet(tiny_model_dir, tmp_path_factory):
    from glue.fleet.fleet import RolloutFleet

    fleet = RolloutFleet(model_path=tiny_model_dir, num_engines=2, engine_args=["--num-threads", "1"],
                         log_dir=tmp_path_factory.mktemp("keyed_fleet_logs"), engine_startup_timeout_s=120,
                         api_key=API_KEY, admin_api_key=ADMIN_KEY)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def generate_through(client, n: int = 4) -> list[dict]:
    async def run():
        try:
            return await asyncio.gather(*(client.generate([1, 2, 3], GREEDY["sampling_params"]) for _ in range(n)))
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_a_keyed_fleet_starts_its_engines_locked_and_registers_them_with_the_router(keyed_fleet):
    assert keyed_fleet.registered_workers() == {url: True for url in keyed_fleet.engine_urls}
    for url in keyed_fleet.engine_urls:
        assert send(url, "/generate", GREEDY)[0] == 401
        assert send(url, "/pause_generation", {"mode": "abort"}, key=API_KEY)[0] == 401
    assert send(keyed_fleet.router_url, "/generate", GREEDY)[0] == 401  # the router asks its clients for the key


def test_generation_through_the_router_works_with_the_api_key_and_is_refused_without(keyed_fleet):
    from glue.fleet.engine_client import EngineClient, EngineHTTPError

    client = EngineClient(keyed_fleet.router_url, keyed_fleet.engine_urls, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    outputs = generate_through(client)
    assert [len(o["output_ids"]) for o in outputs] == [2, 2, 2, 2]
    client.pause_generation("abort")
    client.continue_generation()
    client.flush_cache()
    assert client.weight_versions() == ["0", "0"] and client.health() == [True, True]

    keyless = EngineClient(keyed_fleet.router_url, keyed_fleet.engine_urls)
    with pytest.raises(EngineHTTPError) as err:
        generate_through(keyless, n=1)
    assert err.value.status == 401
    with pytest.raises(EngineHTTPError) as err:
        keyless.pause_generation("abort")
    assert err.value.status == 401
    api_only = EngineClient(keyed_fleet.router_url, keyed_fleet.engine_urls, api_key=API_KEY)
    with pytest.raises(EngineHTTPError) as err:
        api_only.flush_cache()  # the admin routes refuse the api key once an admin key is set
    assert err.value.status == 401


def model_with_seed(tmp_path_factory, seed: int):
    from transformers import AutoModelForCausalLM

    from glue.embedded_engine.tiny_model import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp(f"keyed_seed{seed}"), seed=seed)
    return AutoModelForCausalLM.from_pretrained(path)


def bridge_for(fleet, model, transport: str, tmp_path, **keys):
    from glue.loop.config import SyncConfig
    from weight_sync.bridge import make_bridge
    from weight_sync.sender import LocalWeightSource

    source = LocalWeightSource({n: p.detach().clone() for n, p in model.named_parameters()})
    cfg = SyncConfig(transport=transport, bucket_bytes=40_000, verify="full", disk_dir=str(tmp_path / "ckpt"))
    return make_bridge(cfg, source=source, engine_urls=fleet.engine_urls, **keys)


@pytest.mark.parametrize("transport,version", [("broadcast", 21), ("ipc", 22), ("disk", 23)])
def test_a_full_weight_sync_with_keys_set_lands_and_verifies(keyed_fleet, tmp_path_factory, tmp_path, transport,
                                                             version):
    from glue.fleet.engine_client import EngineClient

    model = model_with_seed(tmp_path_factory, version)
    bridge = bridge_for(keyed_fleet, model, transport, tmp_path, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    try:
        bridge.sync(version)  # verify="full": every engine tensor's checksum equals the source's
    finally:
        bridge.close()
    client = EngineClient(keyed_fleet.router_url, keyed_fleet.engine_urls, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    assert client.weight_versions() == [str(version)] * 2
    outputs = generate_through(client, n=2)
    assert all(o["meta_info"]["weight_version"] == str(version) for o in outputs)


def test_a_bridge_without_any_key_is_refused_by_keyed_engines_when_it_connects(keyed_fleet, tmp_path_factory,
                                                                               tmp_path):
    from weight_sync.engine_calls import WeightSyncError

    model = model_with_seed(tmp_path_factory, 31)
    # the bridge first asks each engine what it offers (/get_server_info, an api-key route)
    with pytest.raises(WeightSyncError, match="get_server_info answered 401"):
        bridge_for(keyed_fleet, model, "ipc", tmp_path)


def test_a_bridge_without_the_admin_key_is_refused_by_keyed_engines_before_any_weight_moves(
        keyed_fleet, tmp_path_factory, tmp_path):
    from weight_sync.engine_calls import WeightSyncError

    model = model_with_seed(tmp_path_factory, 31)
    bridge = bridge_for(keyed_fleet, model, "ipc", tmp_path, api_key=API_KEY)
    try:  # the update session is the first admin route of a sync
        with pytest.raises(WeightSyncError, match="begin_weight_update answered 401"):
            bridge.sync(31)
    finally:
        bridge.close()


def test_a_late_engine_joins_a_keyed_fleet_through_the_bridge_and_the_router(keyed_fleet, tmp_path_factory, tmp_path):
    from glue.fleet.engine_client import EngineClient

    model = model_with_seed(tmp_path_factory, 41)
    bridge = bridge_for(keyed_fleet, model, "broadcast", tmp_path, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    try:
        bridge.sync(41)
        url = keyed_fleet.add_engine(prepare=bridge.add_engine)  # POST /workers carries the key for the router
    finally:
        bridge.close()
    assert keyed_fleet.registered_workers() == {u: True for u in keyed_fleet.engine_urls}
    assert send(url, "/generate", GREEDY)[0] == 401
    client = EngineClient(keyed_fleet.router_url, keyed_fleet.engine_urls, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    assert client.weight_versions() == ["41"] * 3
    assert len(generate_through(client, n=6)) == 6
