"""Weight syncs that land while requests are in flight, on a real embedded engine over loopback HTTP: a pause answers
only once no forward runs until continue; retract recomputes a request's KV with the weights current when it is
re-admitted, so every token's logprob is the teacher-forced logprob of the model its version names; and a sample
resumed across two syncs (client-side after "abort", engine-side after "retract") carries 0, 1, 2 at the right
token boundaries."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from glue.fleet.engine_client import EngineClient
from glue.rollout.manager import RolloutContext
from rollout_fns.single_turn import generate_one
from helpers.engines import call, teacher_forced_logprobs

LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    """Weight version -> (checkpoint directory, HF model): version "0" is the engine's own seed-0 model."""
    from transformers import AutoModelForCausalLM

    from glue.embedded_engine.tiny_model import save_tiny_model

    paths = {"0": tiny_model_dir, "1": save_tiny_model(tmp_path_factory.mktemp("seed1"), seed=1),
             "2": save_tiny_model(tmp_path_factory.mktemp("seed2"), seed=2)}
    return {v: (p, AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()) for v, p in paths.items()}


@pytest.fixture(scope="module")
def engine(engine_processes, tiny_model_dir) -> str:
    return engine_processes.start(tiny_model_dir, "--seed", "0", "--max-running-requests", "8")


@pytest.fixture
def engine_url(engine, models) -> str:
    """The engine, generating, with the seed-0 weights tagged "0" (whatever the previous test left)."""
    assert call(engine, "/continue_generation", {})[0] == 200
    load_weights(engine, models["0"][0], "0")
    return engine


def load_weights(url: str, model_path: str, version: str) -> None:
    status, answer = call(url, "/update_weights_from_disk", {"model_path": model_path, "weight_version": version,
                                                             "abort_all_requests": False})
    assert status == 200 and answer["success"] is True, answer


def engine_state(url: str) -> dict:
    return call(url, "/get_server_info")[1]["internal_states"][0]


def wait_for_forwards(url: str, count: int, timeout_s: float = 120.0) -> None:
    """Poll until the engine has run `count` forwards since it started."""
    deadline = time.monotonic() + timeout_s
    while engine_state(url)["forward_count"] < count:
        assert time.monotonic() < deadline, f"the engine did not reach {count} forwards in {timeout_s} s"
        time.sleep(0.005)


def sync_while_generating(url: str, mode: str, models: dict, versions: list[str], steps: int) -> None:
    """For each version: let `steps` more forwards run, pause in `mode`, load that version's weights, continue."""
    for version in versions:
        wait_for_forwards(url, engine_state(url)["forward_count"] + steps)
        assert call(url, "/pause_generation", {"mode": mode})[0] == 200
        try:
            load_weights(url, models[version][0], version)
        finally:
            assert call(url, "/continue_generation", {})[0] == 200


def in_background(target, *args) -> threading.Thread:
    """Run `target(*args)` in a thread; `thread.error` holds what it raised (check it after join)."""
    def run() -> None:
        try:
            target(*args)
        except BaseException as e:  # handed to the test thread, which raises it
            thread.error = e

    thread = threading.Thread(target=run, daemon=True)
    thread.error = None
    thread.start()
    return thread


def version_boundaries(versions: list) -> list[int]:
    """Token indices where the version differs from the token before."""
    return [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]


def logprob_gaps(models: dict, prompt: list[int], tokens: list[int], logprobs: list[float], versions: list
                 ) -> dict[str, float]:
    """Per version: the largest |engine logprob - teacher-forced logprob of that version's model over prompt +
    every output token| among the tokens stamped with it."""
    gaps: dict[str, float] = {}
    for version in dict.fromkeys(str(v) for v in versions):
        reference = teacher_forced_logprobs(models[version][1], prompt, tokens, 1.0)
        gaps[version] = max(abs(logprobs[i] - reference[i]) for i, v in enumerate(versions) if str(v) == version)
    return gaps


def test_pause_in_place_or_retract_answers_only_once_no_forward_runs_until_continue(engine_url, models):
    # Eight prompt lengths: a step that admits them runs eight prefill forwards and a decode, so a pause that
    # arrives just after continue lands inside a step (and so does one after each retract's re-admission).
    prompts = [[(7 * i + 3 * j) % 30 + 2 for j in range(500 + 100 * i)] for i in range(8)]
    params = {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}
    outputs: list = []
    assert call(engine_url, "/pause_generation", {"mode": "in_place"})[0] == 200
    runner = in_background(lambda: outputs.extend(call(engine_url, "/generate", {
        "input_ids": prompts, "sampling_params": params, "return_logprob": True}, timeout=300)[1]))
    while engine_state(engine_url)["num_waiting_reqs"] < 8:
        time.sleep(0.01)
    assert call(engine_url, "/continue_generation", {})[0] == 200
    for mode in ["in_place", "retract"] * 3:
        assert call(engine_url, "/pause_generation", {"mode": mode})[0] == 200
        state = engine_state(engine_url)
        time.sleep(0.3)
        assert engine_state(engine_url)["forward_count"] == state["forward_count"], f"a forward ran after {mode} pause"
        # all 8 are still in flight: retract moved them to the queue, in_place kept them in the running batch
        expected = (0, 8) if mode == "retract" else (8, 0)
        assert (state["num_running_reqs"], state["num_waiting_reqs"]) == expected, state
        assert call(engine_url, "/continue_generation", {})[0] == 200
        wait_for_forwards(engine_url, state["forward_count"] + 3)
    runner.join(timeout=300)
    assert runner.error is None and len(outputs) == 8, runner.error
    for prompt, out in zip(prompts, outputs):  # three retractions later, still the model's own distribution
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
        logprobs = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        gaps = logprob_gaps(models, prompt, out["output_ids"], logprobs, ["0"] * len(logprobs))
        assert gaps["0"] < LOGPROB_TOLERANCE, gaps


def _generate_across_one_sync(url: str, models: dict, mode: str) -> dict:
    prompt = [4, 2, 9]
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 300, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}}
    answer: dict = {}
    runner = in_background(lambda: answer.update(call(url, "/generate", body, timeout=300)[1]))
    sync_while_generating(url, mode, models, ["1"], steps=20)
    runner.join(timeout=300)
    assert runner.error is None, runner.error
    meta = answer["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"], spans
    assert 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == 300
    versions = [s["version"] for s in spans for _ in range(s["start"], s["end"])]
    return logprob_gaps(models, prompt, answer["output_ids"], [e[0] for e in meta["output_token_logprobs"]], versions)


def test_the_kv_cache_never_mixes_versions_a_retracted_request_is_prefilled_again_with_the_new_weights(
        engine_url, models):
    gaps = _generate_across_one_sync(engine_url, models, "retract")
    print(f"retract: largest logprob gap per version {gaps}")
    assert gaps["0"] < LOGPROB_TOLERANCE and gaps["1"] < LOGPROB_TOLERANCE, gaps
    # in_place keeps the old KV: the tokens after the sync attend to keys and values the old weights computed
    load_weights(engine_url, models["0"][0], "0")
    mixed = _generate_across_one_sync(engine_url, models, "in_place")
    print(f"in_place: largest logprob gap per version {mixed}")
    assert mixed["0"] < LOGPROB_TOLERANCE and mixed["1"] > 1e-3, mixed


class AnswerLog:
    """A GenerateClient that remembers each /generate answer's length and finish reason."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.answers: list[tuple[int, str]] = []

    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True) -> dict:
        out = await self.client.generate(input_ids, sampling_params, return_logprob)
        self.answers.append((len(out["output_ids"]), out["meta_info"]["finish_reason"]["type"]))
        return out


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_a_sample_generated_across_two_syncs_carries_each_version_from_the_token_where_it_began(
        engine_url, models, mode):
    budget = 400
    client = EngineClient(engine_url, [engine_url])
    log = AnswerLog(client)
    ctx = RolloutContext(client=log, sampling_params={"max_new_tokens": budget, "temperature": 1.0, "ignore_eos": True},
                         reward_fn=lambda s: 0.0, group_id=0)

    async def scenario():
        try:
            return await generate_one(ctx, {"prompt_tokens": [5, 3, 8]}, 0)
        finally:
            await client.aclose()

    syncs = in_background(sync_while_generating, engine_url, mode, models, ["1", "2"], 25)
    sample = asyncio.run(scenario())
    syncs.join(timeout=300)
    assert syncs.error is None, syncs.error
    assert len(sample.response_tokens) == budget
    assert sample.versions == sorted(sample.versions) and list(dict.fromkeys(sample.versions)) == [0, 1, 2]
    boundaries = version_boundaries(sample.versions)
    if mode == "abort":  # each sync ended a /generate answer; the client went on from prompt + response so far
        lengths = [n for n, _ in log.answers]
        assert [reason for _, reason in log.answers] == ["abort", "abort", "length"], log.answers
        assert boundaries == [lengths[0], lengths[0] + lengths[1]], (boundaries, log.answers)
    else:  # the engine retracted and re-admitted the request: one answer, three spans
        assert log.answers == [(budget, "length")]
    gaps = logprob_gaps(models, sample.prompt_tokens, sample.response_tokens, sample.rollout_logprobs,
                        sample.versions)
    print(f"{mode}: boundaries {boundaries}, answers {log.answers}, largest logprob gap per version {gaps}")
    assert all(gap < LOGPROB_TOLERANCE for gap in gaps.values()), gaps
