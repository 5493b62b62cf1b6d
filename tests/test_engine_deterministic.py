"""`--enable-deterministic-inference` on the embedded engine: a request's tokens and logprobs depend only on the
weights, its context and its sampling_seed, bit for bit: not on the requests beside it, not on a pause that retracts
it, and a request continued from part of its output draws what the whole one drew (what exact resume rests on)."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.engines import call

PROMPT = [0, 5, 6, 7, 4]


def generate(url: str, input_ids: list[int], seed: int, max_new_tokens: int = 24) -> tuple[list[int], list[float]]:
    status, answer = call(url, "/generate", {
        "input_ids": input_ids, "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True,
                            "sampling_seed": seed}})
    assert status == 200, answer
    return answer["output_ids"], [e[0] for e in answer["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def engine(engine_processes, tiny_model_dir):
    return engine_processes.start(tiny_model_dir, "--enable-deterministic-inference")


def test_a_seeded_request_draws_the_same_tokens_alone_and_beside_others(engine):
    alone = generate(engine, PROMPT, seed=11)
    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(generate, engine, [0, 4 + i % 4, 5], 100 + i, 16 + i) for i in range(5)]
        crowded = pool.submit(generate, engine, PROMPT, 11)
        assert crowded.result() == alone  # tokens and logprobs, bit for bit
        assert len({tuple(f.result()[0]) for f in others}) > 1  # the others did generate, differently
    assert generate(engine, PROMPT, seed=12)[0] != alone[0]  # the seed matters


def test_a_request_continued_from_part_of_its_output_draws_what_the_whole_one_drew(engine):
    tokens, logprobs = generate(engine, PROMPT, seed=3)
    for cut in (1, 9, 23):
        rest, rest_logprobs = generate(engine, PROMPT + tokens[:cut], seed=3, max_new_tokens=24 - cut)
        assert rest == tokens[cut:]
        assert rest_logprobs == logprobs[cut:]


def test_server_info_reports_the_mode(engine):
    status, info = call(engine, "/get_server_info")
    assert status == 200 and info["enable_deterministic_inference"] is True
