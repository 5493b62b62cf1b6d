"""Malformed requests on every route of a real embedded engine, the routes taken from its routing table
(`glue.embedded_engine.routes.ROUTES`), so a new route is fuzzed as soon as it is served: broken or non-UTF-8 JSON,
non-objects, 5,000-deep nesting, numbers no 64-bit type holds, empty bodies, wrong Content-Types, every declared
field with a value of every wrong JSON kind, seeded random documents and truncations. Each gets a 4xx whose JSON
names the problem, never a 5xx, and afterwards the engine still generates, unpaused, on its original weights."""
from __future__ import annotations

import http.client
import json
import random
from urllib.parse import urlsplit

import pytest

from glue.embedded_engine.request_schema import SAMPLING_PARAMS, SAMPLING_PARAMS_NEUTRAL
from glue.embedded_engine.routes import ROUTES, Route
from helpers.engines import POOL

JSON = "application/json"
SYNTAX_CASES = {  # name -> (body bytes, Content-Type)
    "broken JSON": (b"{not json", JSON),
    "unclosed array": (b'{"a": [1, 2', JSON),
    "trailing garbage": (b'{"a": 1} {"b": 2}', JSON),
    "invalid UTF-8": (b'{"a": "\xc3\x28"}', JSON),
    "UTF-16 with a BOM": ('{"a": 1}'.encode("utf-16"), JSON),
    "lone continuation bytes": (b"\x80\x80\x80", JSON),
    "null": (b"null", JSON),
    "a list": (b"[1, 2, 3]", JSON),
    "a number": (b"42", JSON),
    "a string": (b'"body"', JSON),
    "true": (b"true", JSON),
    "5000-deep list": (b"[" * 5000 + b"]" * 5000, JSON),
    "5000-deep object": (b'{"a":' * 5000 + b"1" + b"}" * 5000, JSON),
    "5000-deep field": (b'{"input_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}", JSON),
    "40-deep field": (b'{"input_ids": ' + b"[" * 40 + b"]" * 40 + b"}", JSON),
    "NaN": (b'{"a": NaN}', JSON),
    "Infinity": (b'{"a": -Infinity}', JSON),
    "float overflow": (b'{"a": 1e400}', JSON),
    "integer beyond 64 bits": (b'{"a": 9223372036854775808}', JSON),
    "5000-digit integer": (b'{"a": ' + b"9" * 5000 + b"}", JSON),
    "form data": (b"a=1&b=2", "application/x-www-form-urlencoded"),
    "JSON labelled text/plain": (b"{}", "text/plain"),
    "JSON labelled multipart": (b'{"a": 1}', "multipart/form-data; boundary=x"),
    "whitespace only": (b"  \n\t ", JSON),
    "empty": (b"", JSON),
}


def request(url: str, method: str, path: str, body: bytes, content_type: str | None) -> tuple[int, bytes]:
    """One raw HTTP request (bytes exactly as given, any method); (status, body)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def json_kinds(value) -> set[str]:
    """The JSON kinds `value` is, told independently of the server's own check."""
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    return {str: {"string"}, list: {"array"}, dict: {"object"}}[type(value)]


def accepted_kinds(route: Route, name: str) -> set[str]:
    names = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
    return {names[k] for k in route.body[name].kinds}


def wrong_values(route: Route, name: str) -> list:
    return [v for v in POOL if not json_kinds(v) & accepted_kinds(route, name)]


def placeholder(route: Route, name: str):
    """A value of a kind the field takes (for a body that is then only ever sent truncated)."""
    return {str: "x", int: 1, float: 0.5, bool: False, list: [], dict: {}}[route.body[name].kinds[0]]


def random_json(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth < 3 and roll < 0.2:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 3 and roll < 0.35:
        return {rng.choice(["a", "input_ids", "mode", ""]): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}
    return rng.choice(POOL + [None, rng.randrange(-10**6, 10**6), rng.random(), "abort", "weights"])


def assert_refused(status: int, raw: bytes, case: str, *, field: str | None = None) -> None:
    assert 400 <= status < 500, (case, status, raw[:300])
    answer = json.loads(raw)
    message = answer["error"]["message"]
    assert isinstance(message, str) and message, (case, answer)
    assert len(message) <= 2000, case  # the client's value is quoted, never echoed whole
    if field is not None:
        assert answer["error"]["field"] == field and field in message, (case, answer)


@pytest.fixture(scope="module")
def engine(engine_processes, tiny_model_dir):
    url = engine_processes.start(tiny_model_dir, "--seed", "0")
    yield url, engine_processes.procs[-1]


def body_routes() -> list[Route]:
    return [r for r in ROUTES if r.body is not None]


def test_the_routing_table_lists_every_route_and_every_one_is_fuzzed_below():
    paths = {r.path for r in ROUTES}
    assert {"/generate", "/update_weights_from_distributed", "/release_memory_occupation", "/health"} <= paths
    assert len(ROUTES) == len({(r.method, r.path) for r in ROUTES})  # no route listed twice
    assert len(body_routes()) >= 15


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r.method} {r.path}")
def test_malformed_bodies_get_a_4xx_naming_the_problem_on_every_route(engine, route):
    url, _ = engine
    for case, (body, content_type) in SYNTAX_CASES.items():
        status, raw = request(url, route.method, route.path, body, content_type)
        if route.body is None:  # a route that reads no body (health, info, flush) ignores it, as SGLang's do
            assert 200 <= status < 300, (case, status, raw[:300])
        elif case in ("empty", "whitespace only") and route.body_optional:
            assert 200 <= status < 300, (case, status, raw[:300])  # SGLang's optional body: every default
        else:
            assert_refused(status, raw, case, field="Content-Type" if "labelled" in case else None)


@pytest.mark.parametrize("route", body_routes(), ids=lambda r: f"{r.method} {r.path}")
def test_every_declared_field_of_a_wrong_kind_or_missing_gets_a_4xx_naming_it(engine, route):
    url, _ = engine
    required = [name for name, spec in route.body.items() if spec.required]
    if required:
        status, raw = request(url, route.method, route.path, b"{}", JSON)
        assert_refused(status, raw, "{}", field=required[0])
    for name in route.body:
        values = wrong_values(route, name)
        assert len(values) >= 6, name
        for value in values:
            status, raw = request(url, route.method, route.path, json.dumps({name: value}).encode(), JSON)
            assert_refused(status, raw, f"{name}={str(value)[:40]}", field=name)


@pytest.mark.parametrize("route", body_routes(), ids=lambda r: f"{r.method} {r.path}")
def test_random_documents_with_a_wrong_field_and_truncated_bodies_get_4xx(engine, route):
    url, _ = engine
    rng = random.Random(f"{route.method} {route.path}")
    names = list(route.body)
    for i in range(40):
        doc = {name: random_json(rng) for name in rng.sample(names, rng.randrange(len(names) + 1))}
        wrong = rng.choice(names)
        doc[wrong] = rng.choice(wrong_values(route, wrong))  # at least one field of a kind it never takes
        extra = {rng.choice(["zz", "", "\u00e9"]): random_json(rng) for _ in range(rng.randrange(3))}
        status, raw = request(url, route.method, route.path, json.dumps({**extra, **doc}).encode(), JSON)
        assert_refused(status, raw, f"random document {i}: {str(doc)[:200]}")
    whole = json.dumps({name: placeholder(route, name) for name in names}).encode()
    for cut in sorted(rng.sample(range(1, len(whole)), min(15, len(whole) - 1))):
        status, raw = request(url, route.method, route.path, whole[:cut], JSON)
        assert_refused(status, raw, f"truncated at {cut}: {whole[:cut]!r}")


def test_odd_sampling_params_never_get_a_5xx(engine):
    url, _ = engine
    for name in [*SAMPLING_PARAMS, *SAMPLING_PARAMS_NEUTRAL, "made_up"]:
        for value in POOL:
            params = {"max_new_tokens": 2, name: value}
            body = json.dumps({"input_ids": [1, 2], "sampling_params": params}).encode()
            status, raw = request(url, "POST", "/generate", body, JSON)
            if status != 200:
                assert_refused(status, raw, f"sampling_params.{name}={str(value)[:40]}")


def test_the_engine_still_serves_unchanged_after_the_fuzz(engine):
    url, proc = engine
    assert proc.poll() is None
    status, raw = request(url, "GET", "/get_server_info", b"", None)
    info = json.loads(raw)
    state = info["internal_states"][0]
    assert status == 200 and state["is_paused"] is False and state["memory_released"] == []
    assert info["weight_version"] == "0"
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}}
    status, raw = request(url, "POST", "/generate", json.dumps(body).encode(), JSON)
    assert status == 200 and len(json.loads(raw)["output_ids"]) == 3
