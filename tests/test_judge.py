"""The LLM judge on a real fleet: a tiny judge checkpoint in an embedded engine behind the real sgl-router, reached with
the policy's EngineClient. Its generated text is parsed into the score (and equals transformers' own greedy answer
to the same prompt); a judge that runs past timeout_s is cut within the bound, counted, and its engine freed; and a
rollout manager whose groups are judged goes on when the judge fails (zero) or fails just those groups
(drop_group)."""
import asyncio
import json
import time
import urllib.request

import pytest

from glue.fleet.engine_client import EngineClient
from glue.fleet.fleet import RolloutFleet
from glue.rewards.judge import Judge, save_tiny_judge_model
from glue.rewards.models import ModelRewards, SampleText
from rollout_fns.judge import first_number_parser

# No chat template, the answer last: a tiny random model's next token depends mostly on the last few it read
TEMPLATE = "Question: {prompt}\nScore this answer: {response}"
TEXTS = [SampleText(prompt=f"What is {a}+{b}?", response=r, label=str(a + b))
         for a, b, r in [(1, 2, "3"), (4, 4, "9"), (0, 5, "five"), (7, 2, "\\boxed{9}")]]


async def asks_the_judge_itself(ctx, prompt, num_samples):
    """A rollout function that calls the run's judge itself (as a multi-turn one might, per turn)."""
    from rollout_fns.single_turn import generate_group

    samples = await generate_group(ctx, prompt, num_samples)
    for s in samples:
        s.metadata["own_judgement"] = await ctx.judge.judge(SampleText(prompt="", response=str(s.response_tokens),
                                                                       label=""))
    return samples


@pytest.fixture(scope="module")
def judge_fleet(tmp_path_factory):
    path = save_tiny_judge_model(str(tmp_path_factory.mktemp("judge") / "model"), vocab_size=272, seed=1)
    fleet = RolloutFleet(model_path=path, num_engines=1, log_dir=tmp_path_factory.mktemp("judge-logs"),
                         engine_args=["--num-threads", "1"], router_args=["--log-level", "warn"])
    with fleet:
        yield path, fleet


def running_requests(fleet) -> int:
    """Requests the judge engine holds right now (its /server_info)."""
    with urllib.request.urlopen(f"{fleet.engine_urls[0]}/server_info", timeout=5) as resp:
        state = json.loads(resp.read())["internal_states"][0]
    return state["num_running_reqs"] + state["num_waiting_reqs"]


def make_judge(path, fleet, **overrides):
    from transformers import AutoTokenizer

    settings = dict(client=EngineClient(fleet.router_url, fleet.serving_urls),
                    tokenizer=AutoTokenizer.from_pretrained(path), parser=first_number_parser,
                    prompt_template=TEMPLATE, sampling_params={"temperature": 0.0, "max_new_tokens": 2},
                    timeout_s=30.0, max_concurrency=2, apply_chat_template=False)
    return Judge(**{**settings, **overrides})


def greedy_answer(path, ids, max_new_tokens):
    """transformers' own greedy decoding of the same judge prompt: the direct call to compare with."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return AutoTokenizer.from_pretrained(path).decode(out[0, len(ids):], skip_special_tokens=True)


@pytest.mark.slow
def test_the_judges_generated_text_is_parsed_into_the_score_it_would_give_directly(judge_fleet):
    path, fleet = judge_fleet
    judge = make_judge(path, fleet)

    async def judged():
        try:
            return await judge.score(TEXTS)
        finally:
            await judge.client.aclose()

    verdicts = asyncio.run(judged())
    for text, verdict in zip(TEXTS, verdicts):
        direct = greedy_answer(path, judge.input_ids(text), 2)
        assert verdict["text"] == direct and verdict["error"] is None
        assert verdict["score"] == float(direct)  # two digits: the parser read the judge's own answer
    assert len({v["score"] for v in verdicts}) > 1  # the score depends on what the judge read
    metrics = judge.metrics()
    assert metrics["reward/judge_calls"] == 4 and metrics["reward/judge_parse_failures"] == 0
    assert metrics["reward/judge_timeouts"] == 0 and 0 < metrics["reward/judge_s"] <= metrics["reward/judge_s_max"]


@pytest.mark.slow
def test_a_judge_past_its_timeout_is_cut_within_the_bound_and_its_engine_freed(judge_fleet):
    path, fleet = judge_fleet
    slow = make_judge(path, fleet, sampling_params={"temperature": 0.0, "max_new_tokens": 1900}, timeout_s=0.5,
                      max_concurrency=4)  # the tiny judge never stops on its own: 1900 digits take seconds
    quick = make_judge(path, fleet)

    async def judged():
        try:
            started = time.perf_counter()
            verdicts = await slow.score(TEXTS)
            cut_after = time.perf_counter() - started
            started = time.perf_counter()
            while running_requests(fleet) and time.perf_counter() - started < 10:
                await asyncio.sleep(0.05)
            freed_after = time.perf_counter() - started
            return verdicts, cut_after, freed_after, await quick.score(TEXTS[:1])
        finally:
            await slow.client.aclose()
            await quick.client.aclose()

    verdicts, cut_after, freed_after, after = asyncio.run(judged())
    assert all(v["score"] is None and "timed out" in v["error"] for v in verdicts)
    assert cut_after < 0.5 + 1.5, cut_after  # all four at once (max_concurrency 4), each cut at 0.5 s
    metrics = slow.metrics()
    assert metrics["reward/judge_timeouts"] == 4 and metrics["reward/judge_calls"] == 4
    # the engine dropped the cut requests (four 1900-token answers take it ~16 s on 2 CPU cores) and still serves
    assert freed_after < 3.0, freed_after
    assert after[0]["score"] is not None


@pytest.mark.slow
def test_a_rollout_manager_goes_on_when_the_judge_fails_and_drop_group_fails_only_those_groups(judge_fleet, tmp_path):
    from transformers import AutoTokenizer

    from glue.rollout.manager import RolloutManager
    from rollout_fns.arith_data import write_arith_jsonl

    path, fleet = judge_fleet
    write_arith_jsonl(str(tmp_path / "arith.jsonl"), 20, 0)

    async def step(on_failure, max_new_tokens, function="rollout_fns.single_turn:generate_group"):
        # the policy is the judge's checkpoint here too: any text model will do for the plumbing
        judge = make_judge(path, fleet, sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens},
                           timeout_s=0.5, max_concurrency=8, on_failure=on_failure)
        manager = RolloutManager(
            function_path=function, task_path="rollout_fns.text_data:TextDataTask",
            task_args={"path": str(tmp_path / "arith.jsonl"), "tokenizer": path}, client=judge.client,
            sampling_params={"temperature": 1.0, "max_new_tokens": 2}, prompts_per_step=2, samples_per_prompt=2,
            seed=0, group_rewards=ModelRewards(scorers=[judge], tokenizer=AutoTokenizer.from_pretrained(path)))
        try:
            return await manager.generate_step(), judge.metrics()
        finally:
            await judge.client.aclose()

    judged, metrics = asyncio.run(step("zero", 1, function="test_judge:asks_the_judge_itself"))
    assert metrics["reward/judge_calls"] == 4 + 4 and metrics["reward/judge_timeouts"] == 0  # its own + the hook's
    for g in judged:
        assert g.error is None
        for s in g.samples:
            own = s.metadata["own_judgement"]
            assert own["error"] is None and own["score"] == float(own["text"])
            assert s.reward["judge"] == float(s.metadata["judge"]["text"]) and s.reward["score"] == pytest.approx(
                s.reward["task"] + s.reward["judge"])
    zeroed, metrics = asyncio.run(step("zero", 1900))
    assert metrics["reward/judge_timeouts"] == 4
    assert all(g.error is None and s.reward["judge"] == 0.0 for g in zeroed for s in g.samples)
    dropped, metrics = asyncio.run(step("drop_group", 1900))
    assert metrics["reward/judge_timeouts"] == 4
    assert all("judge could not score 2 of 2 samples" in g.error for g in dropped)
