"""HTTP calls to embedded engines, the teacher-forced HF logprobs their answers are checked against, and the
fuzzers' pool of awkward JSON values."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import torch


def call(url: str, path: str, body: dict | None = None, method: str | None = None, timeout: float = 60.0,
         headers: dict[str, str] | None = None):
    """(status, parsed JSON or text) for one HTTP call; non-2xx answers are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method or ("GET" if body is None else "POST"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode()


def generate(url: str, body: dict) -> dict:
    status, out = call(url, "/generate", body)
    assert status == 200, out
    return out


def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T) of each output token from one forward over prompt + output (T=1 for greedy)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(output))
    logprobs = torch.log_softmax(logits[positions] / temperature, dim=-1)
    return logprobs[torch.arange(len(output)), torch.tensor(output)].tolist()


# One value of every JSON kind, extremes included (all within 64 bits: bigger numbers are a syntax case below).
POOL = [True, False, 0, -1, 2**63 - 1, -(2**63), 0.5, -1e308, 1e308, "", "x" * 10_000, "\ud800", [], [1, "a", None],
        [[[[[]]]]], {}, {"k": [1, {"k": None}]}]
