"""SGLang's prompt-logprob request on the embedded engine (lenient and --sglang-strict), directly and through the
real sgl-router: `/generate` with `max_new_tokens: 0`, `return_logprob`, `logprob_start_len` answers
`meta_info.input_token_logprobs` in SGLang's shape, equal to a teacher-forced HF forward."""
from __future__ import annotations

import asyncio

import pytest
import torch

from helpers.engines import call, generate

PROMPT = [0, 5, 9, 7, 3, 11, 2]


@pytest.fixture(scope="module")
def reference_logprobs(tiny_model_dir) -> list[float]:
    """log p(PROMPT[p] | PROMPT[:p]) for p = 1 .. len - 1, from the HF model the engines load."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(PROMPT[1:]).unsqueeze(-1)).squeeze(-1)
    return lp.tolist()


@pytest.fixture(scope="module")
def engines(engine_processes, tiny_model_dir) -> dict[str, str]:
    return {"lenient": engine_processes.start(tiny_model_dir, "--num-threads", "1"),
            "strict": engine_processes.start_sglang_stand_in(tiny_model_dir, "--num-threads", "1")}


def score(url: str, start: int, max_new_tokens: int = 0, **extra) -> dict:
    return generate(url, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start,
                          "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}, **extra})


@pytest.mark.parametrize("face", ["lenient", "strict"])
def test_a_zero_token_request_answers_the_input_logprobs_from_logprob_start_len_as_sglang_does(engines, face,
                                                                                            reference_logprobs):
    url = engines[face]
    for start in (0, 3, len(PROMPT) - 1):
        out = score(url, start)
        entries = out["meta_info"]["input_token_logprobs"]
        # one [logprob, token, None] per input position from `start`; the first logprob is None, as in SGLang
        assert [e[1] for e in entries] == PROMPT[start:] and all(e[2] is None for e in entries)
        assert entries[0][0] is None
        got = [e[0] for e in entries[1:]]
        assert got == pytest.approx(reference_logprobs[start:], abs=1e-5)
        assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert score(url, -1)["meta_info"]["input_token_logprobs"] == []  # SGLang's default: output logprobs only


def test_input_logprobs_come_with_generated_tokens_too_and_in_deterministic_mode(engine_processes, engines,
                                                                                   tiny_model_dir,
                                                                                   reference_logprobs):
    out = score(engines["lenient"], 2, max_new_tokens=3, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(reference_logprobs[2:],
                                                                                           abs=1e-5)
    assert len(out["output_ids"]) == 3
    deterministic = engine_processes.start(tiny_model_dir, "--num-threads", "1", "--enable-deterministic-inference")
    for new in (0, 2):
        entries = score(deterministic, 1, max_new_tokens=new)["meta_info"]["input_token_logprobs"]
        assert [e[0] for e in entries[1:]] == pytest.approx(reference_logprobs[1:], abs=1e-5)


def test_a_start_past_the_input_is_refused_naming_the_field(engines):
    for url in engines.values():
        status, body = call(url, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                               "logprob_start_len": len(PROMPT) + 1,
                                               "sampling_params": {"max_new_tokens": 0}})
        assert status == 400 and "logprob_start_len" in str(body)


def test_the_router_carries_logprob_start_len_to_the_engines(tiny_model_dir, tmp_path, reference_logprobs):
    from glue.fleet.engine_client import EngineClient
    from glue.fleet.fleet import RolloutFleet

    with RolloutFleet(model_path=tiny_model_dir, num_engines=1, engine_args=["--num-threads", "1", "--sglang-strict"],
                      log_dir=tmp_path) as fleet:
        client = EngineClient(fleet.router_url, fleet.engine_urls)

        async def ask() -> dict:
            try:
                return await client.generate(PROMPT, {"max_new_tokens": 0}, logprob_start_len=4)
            finally:
                await client.close()

        out = asyncio.run(ask())
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT[4:]
    assert [e[0] for e in entries[1:]] == pytest.approx(reference_logprobs[4:], abs=1e-5)
