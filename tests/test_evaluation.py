"""Held-out evaluation (glue.loop.evaluation): the unbiased pass@k, the eval metrics, the same prompts every time with the
eval sampling, and, inside the loop in sync and async mode, at the start and every interval on a known weight
version without a single eval group reaching the training buffer."""
from __future__ import annotations

import asyncio
import itertools
import math
import random

import pytest

from glue.loop.buffer import RolloutBuffer
from glue.loop.colocation import Disaggregated
from glue.loop.controller import LoopHooks, LoopParts, run_loop
from glue.loop.evaluation import Evaluator, eval_metrics, pass_at_k, passes
from glue.metrics.logger import MetricsLogger, read_metrics
from glue.loop.staleness import StalenessGate
from glue.loop.stream import RolloutStream
from glue.types import Group, Sample, SampleStatus
from loss import LossConfig
from rollout_fns.single_turn import generate_group
from helpers.fleet import ScriptedBridge, ScriptedFleet
from helpers.managers import NeverCheckpointed


@pytest.mark.parametrize("n,c", [(4, 0), (4, 1), (5, 2), (6, 6), (8, 3)])
def test_pass_at_k_is_the_share_of_k_subsets_that_hold_a_passing_answer(n, c):
    answers = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(answers, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_refuses_k_beyond_the_answers():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def scored(group_id, index, reward, versions=(0,), status=SampleStatus.COMPLETED):
    s = Sample(prompt_tokens=[1], group_id=group_id, index=index, reward=reward, status=status)
    for v in versions:
        s.append_response([7], [-1.0], v)
    return s


def test_an_answer_passes_on_its_correct_entry_or_else_its_score():
    assert passes(scored(0, 0, {"score": -0.5, "correct": 1.0}), 1.0)  # a format penalty does not unmake it
    assert not passes(scored(0, 0, {"score": 1.0, "correct": 0.0}), 1.0)
    assert passes(scored(0, 0, 0.75), 0.5) and not passes(scored(0, 0, 0.25), 0.5)
    assert not passes(scored(0, 0, 1.0, status=SampleStatus.FAILED), 1.0)


def test_eval_metrics_average_pass_at_k_over_prompts_and_report_the_versions_that_answered():
    groups = [Group(group_id=-1, samples=[scored(-1, 0, {"score": 1.0, "correct": 1.0, "format_ok": 1.0}, (3,)),
                                          scored(-1, 1, {"score": 0.0, "correct": 0.0, "format_ok": 1.0}, (3, 4))]),
              Group(group_id=-2, samples=[scored(-2, 0, {"score": 0.0, "correct": 0.0, "format_ok": 0.0}, (4,)),
                                          scored(-2, 1, {"score": 0.0, "correct": 0.0, "format_ok": 0.0}, (4,))])]
    m = eval_metrics(groups, ks=[1, 2], threshold=1.0)
    assert m["eval/reward_mean"] == pytest.approx(0.25)
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["eval/pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval/reward/correct"] == pytest.approx(0.25) and m["eval/reward/format_ok"] == pytest.approx(0.5)
    assert (m["eval/weight_version"], m["eval/weight_version_max"]) == (3.0, 4.0)
    assert m["eval/num_samples"] == 4.0 and m["eval/failed_groups"] == 0.0


class CountingTask:
    """Prompts [0, t] with t seeded in [2, 30); the reward is 1 when the first response token is t."""

    def prompts(self, seed):
        rng = random.Random(seed)
        for _ in itertools.count():
            yield {"prompt_tokens": [0, rng.randrange(2, 30)]}

    def reward(self, sample):
        is_echo = float(sample.response_tokens[:1] == sample.prompt_tokens[-1:])
        return {"score": is_echo, "correct": is_echo}


class EchoingClient:
    """Speaks SGLang's /generate answer: echoes the last input token `echo_every`-th call, else token 1; the answer
    carries the version `holder.version` (the engines' weights)."""

    def __init__(self, holder, echo_every=2):
        self.holder, self.echo_every, self.calls = holder, echo_every, []

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        self.calls.append((list(input_ids), dict(sampling_params)))
        token = input_ids[-1] if len(self.calls) % self.echo_every == 0 else 1
        await asyncio.sleep(0)
        return {"output_ids": [token], "meta_info": {"output_token_logprobs": [[-0.5, token, None]],
                                                     "finish_reason": {"type": "stop"},
                                                     "weight_version": str(self.holder.version)}}


class Engine:
    version = 0


def test_every_evaluation_answers_the_same_prompts_with_the_eval_sampling_and_negative_group_ids():
    client = EchoingClient(Engine())
    evaluator = Evaluator(fn=generate_group, task=CountingTask(), client=client,
                          sampling_params={"temperature": 0.0, "max_new_tokens": 1}, interval=5, seed=3,
                          num_prompts=6, samples_per_prompt=2, ks=[1, 2])
    first = asyncio.run(evaluator.evaluate(0))
    prompts_first = [ids for ids, _ in client.calls]
    client.calls.clear()
    assert asyncio.run(evaluator.evaluate(3)) == {}  # not due
    assert not client.calls
    second = asyncio.run(evaluator.evaluate(10))
    assert sorted(ids for ids, _ in client.calls) == sorted(prompts_first)
    assert len(prompts_first) == 6 * 2 and len({tuple(p) for p in prompts_first}) > 1
    expected = [p["prompt_tokens"] for p in itertools.islice(CountingTask().prompts(3), 6)]
    assert sorted(map(tuple, prompts_first)) == sorted(tuple(p) for p in expected for _ in range(2))
    assert all(params == {"temperature": 0.0, "max_new_tokens": 1} for _, params in client.calls)
    # every second answer echoes: each prompt has one passing answer of two
    assert first["eval/pass@1"] == second["eval/pass@1"] == pytest.approx(0.5)
    assert first["eval/pass@2"] == pytest.approx(1.0) and first["eval/reward_mean"] == pytest.approx(0.5)
    assert first["eval/time_s"] > 0 and evaluator.evaluations == 2


def test_an_eval_group_whose_rollout_function_raises_is_counted_not_fatal(capsys):
    async def flaky(ctx, prompt, num_samples):
        if ctx.group_id == -2:
            raise RuntimeError("sandbox down")
        return await generate_group(ctx, prompt, num_samples)

    evaluator = Evaluator(fn=flaky, task=CountingTask(), client=EchoingClient(Engine(), echo_every=1),
                          sampling_params={}, interval=1, num_prompts=3, samples_per_prompt=2, ks=[1])
    m = asyncio.run(evaluator.evaluate(1))
    assert m["eval/failed_groups"] == 1.0
    assert m["eval/pass@1"] == pytest.approx(2 / 3)  # the failed prompt's answers do not pass
    assert "eval group -2 failed: RuntimeError: sandbox down" in capsys.readouterr().err


# ---- inside the loop ----
class Manager(NeverCheckpointed):
    """Training groups of 2 samples, rewards 0 and 1, tokens at the engine's version when produced."""

    def __init__(self, engine):
        self.engine, self.next_id, self.rng = engine, 0, random.Random(0)

    def next_group(self):
        gid, self.next_id = self.next_id, self.next_id + 1
        return gid, self._generate(gid)

    async def _generate(self, gid):
        samples = [Sample(prompt_tokens=[0, 1], group_id=gid, index=i) for i in range(2)]
        for _ in range(2):
            await asyncio.sleep(self.rng.uniform(0, 0.005))
            for s in samples:
                s.append_response([2], [-1.0], self.engine.version)
        for i, s in enumerate(samples):
            s.reward = float(i)
        return Group(group_id=gid, samples=samples)


class Trainer:
    def __init__(self):
        self.version = 0

    def train_step(self, batch):
        self.version += 1
        return {"train/loss": 0.0}


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_the_loop_evaluates_at_the_start_and_every_interval_on_the_synced_version_outside_the_buffer(
        tmp_path, max_staleness):
    engine, steps, per_step = Engine(), 6, 3
    gate = StalenessGate(groups_per_step=per_step, max_staleness=max_staleness)
    buffer = RolloutBuffer(groups_per_step=per_step)
    manager = Manager(engine)
    stream = RolloutStream(manager=manager, gate=gate, buffer=buffer, max_groups=steps * per_step)
    evaluator = Evaluator(fn=generate_group, task=CountingTask(), client=EchoingClient(engine), sampling_params={},
                          interval=3, num_prompts=4, samples_per_prompt=2, ks=[1, 2])
    seen_in_buffer = []
    original_finished = buffer.finished
    buffer.finished = lambda group: (seen_in_buffer.append(group.group_id), original_finished(group))
    logger = MetricsLogger(tmp_path / "m.jsonl")
    parts = LoopParts(stream=stream, trainer=Trainer(), fleet=ScriptedFleet(),
                      phases=Disaggregated(ScriptedBridge(engine)), logger=logger,
                      hooks=LoopHooks(evaluate=evaluator.evaluate))
    asyncio.run(run_loop(parts, num_steps=steps, loss_cfg=LossConfig()))
    records = read_metrics(logger.path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    evaluated = {r["step"]: r for r in records if "eval/pass@1" in r}
    assert sorted(evaluated) == [0, 3, 6]
    for step, r in evaluated.items():  # the sync of that step came first: every answer is on its weights
        assert r["eval/weight_version"] == r["eval/weight_version_max"] == step
        assert r["eval/num_samples"] == 8 and r["eval/pass@2"] == pytest.approx(1.0)
    # the training side saw exactly its own groups: ids 0.., 3 per step x 2 samples, none negative
    assert sorted(seen_in_buffer) == list(range(steps * per_step)) == list(range(manager.next_id))
    assert [r["rollout/num_samples"] for r in records[1:]] == [per_step * 2] * steps
    assert gate.admitted == steps * per_step
    assert not any(r.get("rollout/group_ids", "").startswith("-") for r in records)
    assert math.isnan(records[0].get("rollout/reward_mean", math.nan))  # the step-0 record is eval only
