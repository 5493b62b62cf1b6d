"""slime's rollout layer as slime's functions use it: `slime.rollout.sglang_rollout`'s generate_and_rm /
generate_and_rm_group (one sample's generate function and reward, a group's, aborts, group rewards), the data source a
whole-rollout function pulls groups from (slime's buffer-then-data-set semantics: never an empty batch), and the
long-lived whole-rollout contract: one call per step's groups, a background worker kept between calls, stopped by the
exit hook its module registered when the run ends, with no thread left behind."""
from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
import types

import pytest

from glue.rollout.slime import http_calls, shim
from glue.rollout.slime.adapter import SlimeFunctions, load_function, slime_args
from glue.rollout.slime.data_source import PromptDataSource
from glue.rollout.slime.http_calls import Fleet
from glue.rollout.slime.rollout_calls import RolloutCalls
from glue.rollout.slime.sample import Sample as SlimeSample
from glue.rollout.slime.sample import from_prompt

shim.install()  # what sluice does before loading a slime function; slime itself is not installed here

from slime.rollout.sglang_rollout import GenerateState, generate_and_rm, generate_and_rm_group  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

CALLS: list[dict] = []  # what the generate and reward functions below were given


# --- a generate and a reward function in slime's signatures (no engine: the answer is worked out here) ------------

async def generate_two_tokens(args, sample: Sample, sampling_params) -> Sample:
    CALLS.append({"fn": "generate", "index": sample.index, "params": sampling_params,
                  "session": sample.session_id})
    sampling_params["max_new_tokens"] -= 1  # a function may change its copy; the others' stay as they were
    sample.append_response_tokens(args, tokens=[7, 8], log_probs=[-0.5, -0.25], text="ab",
                                  meta_info={"finish_reason": {"type": "stop"}, "weight_version": "3"})
    return sample


async def generate_aborted_once(args, sample: Sample, sampling_params) -> Sample:
    """The first turn is cut by an abort-mode pause; a sample given again continues from its tokens."""
    finish = "abort" if sample.status == Sample.Status.PENDING else "stop"
    CALLS.append({"fn": "generate", "index": sample.index, "finish": finish, "tokens": list(sample.tokens)})
    sample.append_response_tokens(args, tokens=[7], log_probs=[-0.5], text="a",
                                  meta_info={"finish_reason": {"type": finish}, "weight_version": "1"})
    return sample


async def reward_by_index(args, sample, **kwargs):
    if isinstance(sample, list):  # slime's batched form (group_rm): one reward per sample
        CALLS.append({"fn": "group_reward", "n": len(sample)})
        return [10.0 + s.index for s in sample]
    CALLS.append({"fn": "reward", "index": sample.index})
    return float(sample.index)


@pytest.fixture
def rm_hub():
    shim.install()


def args_for(text_model_dir, **overrides):
    args = slime_args(router_url="http://127.0.0.1:1", model_path=text_model_dir,
                      sampling_params={"max_new_tokens": 4}, samples_per_prompt=3, prompts_per_step=2, seed=0,
                      generate_path="test_slime_rollout.generate_two_tokens",
                      reward_path="test_slime_rollout.reward_by_index")
    vars(args).update(overrides)
    return args


def group_of(n: int) -> list[Sample]:
    return [Sample(index=i, group_index=0, tokens=[1, 2], prompt="p") for i in range(n)]


# --- generate_and_rm / generate_and_rm_group -----------------------------------------------------------------------

def test_generate_and_rm_group_runs_the_generate_function_and_the_reward_once_per_sample(text_model_dir, rm_hub):
    args, CALLS[:] = args_for(text_model_dir), []
    params = {"max_new_tokens": 4}
    group = asyncio.run(generate_and_rm_group(args, group_of(3), params))
    assert [(s.response, s.loss_mask, s.reward, s.status) for s in group] == \
        [("ab", [1, 1], float(i), Sample.Status.COMPLETED) for i in range(3)]
    generated = [c for c in CALLS if c["fn"] == "generate"]
    assert sorted(c["index"] for c in generated) == [0, 1, 2] and params == {"max_new_tokens": 4}
    assert all(c["params"] == {"max_new_tokens": 3} for c in generated)  # each its own copy
    assert len({c["session"] for c in generated}) == 3 and None not in {c["session"] for c in generated}
    assert sorted(c["index"] for c in CALLS if c["fn"] == "reward") == [0, 1, 2]


def test_group_rm_scores_the_group_once_after_all_its_samples(text_model_dir, rm_hub):
    args, CALLS[:] = args_for(text_model_dir, group_rm=True), []
    group = asyncio.run(generate_and_rm_group(args, group_of(3), {"max_new_tokens": 4}))
    assert [s.reward for s in group] == [10.0, 11.0, 12.0]
    assert [c["fn"] for c in CALLS] == ["generate"] * 3 + ["group_reward"]


def test_while_aborted_a_group_comes_back_as_given_and_a_sample_comes_back_aborted_unscored(text_model_dir, rm_hub):
    args, CALLS[:] = args_for(text_model_dir), []
    state = GenerateState(args)
    state.aborted = True
    try:
        group = group_of(2)
        assert asyncio.run(generate_and_rm_group(args, group, {"max_new_tokens": 4})) is group
        assert all(s.status == Sample.Status.PENDING and s.session_id is None for s in group)
        sample = asyncio.run(generate_and_rm(args, group_of(1)[0], {"max_new_tokens": 4}))
        assert (sample.status, sample.reward, CALLS) == (Sample.Status.ABORTED, None, [])
    finally:
        state.reset()
    done = Sample(index=0, tokens=[1, 2, 3], response="x", response_length=1, reward=0.5,
                  status=Sample.Status.COMPLETED)
    assert asyncio.run(generate_and_rm(args, done, {"max_new_tokens": 4})) is done and CALLS == []


def test_generate_state_carries_slime_s_sampling_params_and_is_one_per_run(text_model_dir):
    args = args_for(text_model_dir)
    state = GenerateState(args)
    assert GenerateState(args) is state and GenerateState(args_for(text_model_dir)) is not state
    assert state.sampling_params == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4,
                                     "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
                                     "no_stop_trim": True, "spaces_between_special_tokens": False}
    assert (state.aborted, state.remaining_batch_size, state.pendings) == (False, 0, set())
    assert state.tokenizer.decode(state.tokenizer.encode("hello")) == "hello"


def test_slime_s_default_rollout_takes_a_step_s_groups_and_continues_a_group_cut_by_an_abort(text_model_dir,
                                                                                             rm_hub):
    from slime.rollout.sglang_rollout import generate_rollout

    args, CALLS[:] = args_for(text_model_dir, custom_generate_function_path="test_slime_rollout.generate_aborted_once",
                              n_samples_per_prompt=2), []
    source, drawn = prompts_source()
    output = generate_rollout(args, 0, source)
    assert [[(s.index, s.tokens, s.status, s.reward) for s in g] for g in output.samples] == [
        [(0, [100, 7, 7], Sample.Status.COMPLETED, 0.0), (1, [100, 7, 7], Sample.Status.COMPLETED, 1.0)],
        [(2, [101, 7, 7], Sample.Status.COMPLETED, 2.0), (3, [101, 7, 7], Sample.Status.COMPLETED, 3.0)]]
    continued = [c["tokens"] for c in CALLS if c["fn"] == "generate" and c["finish"] == "stop"]
    assert sorted(continued) == [[100, 7]] * 2 + [[101, 7]] * 2  # from the tokens the abort left
    assert drawn == [100, 101] and GenerateState(args).pendings == set()
    with pytest.raises(ValueError, match="evaluates each eval prompt through generate_and_rm"):
        generate_rollout(args, 0, source, evaluation=True)


# --- the data source -----------------------------------------------------------------------------------------------

def prompts_source(samples_per_prompt: int = 2) -> tuple[PromptDataSource, list[int]]:
    drawn = []

    def draw() -> dict:
        drawn.append(100 + len(drawn))
        return {"prompt_tokens": [drawn[-1]], "label": f"drawn {drawn[-1]}"}

    def to_sample(prompt, group_index, index):
        return from_prompt(prompt, text="", group_id=group_index, index=index)

    return PromptDataSource(samples_per_prompt=samples_per_prompt, draw=draw, to_sample=to_sample), drawn


def test_the_data_source_hands_out_given_back_groups_then_admitted_prompts_then_draws_more_never_none():
    source, drawn = prompts_source()
    source.offer({"prompt_tokens": [1], "label": "a"})
    first = source.get_samples(3)  # one admitted prompt, two more drawn from the task: slime's data set never ends
    assert [[(s.tokens, s.label, s.group_index, s.index) for s in g] for g in first] == [
        [([1], "a", 0, 0), ([1], "a", 0, 1)], [([100], "drawn 100", 1, 2), ([100], "drawn 100", 1, 3)],
        [([101], "drawn 101", 2, 4), ([101], "drawn 101", 2, 5)]]
    assert first[0][0] is not first[0][1] and drawn == [100, 101]
    source.add_samples([first[1]])  # given back (an aborted group): handed out first, as it was
    again = source.get_samples(2)
    assert again[0] is first[1] and [s.group_index for s in again[1]] == [3, 3]
    assert (len(source), source.get_buffer_length(), source.get_samples(0), source.add_samples([])) == (0, 0, [], None)
    with pytest.raises(ValueError, match="a group of 1 samples; each holds n_samples_per_prompt=2"):
        source.add_samples([first[0][:1]])
    with pytest.raises(TypeError, match="takes a list of groups"):
        source.add_samples([first[0][0]])


# --- the long-lived whole-rollout contract -------------------------------------------------------------------------

FULLY_ASYNC = '''
"""A whole-rollout function with a background worker, the way slime's fully-async rollout keeps one."""
import asyncio
import atexit
import queue
import threading

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.utils.types import Sample

WORKERS, CALLS = [], []


class Worker:
    def __init__(self, data_source, batch):
        self.data_source, self.batch, self.done, self.running = data_source, batch, queue.Queue(), True
        self.thread = threading.Thread(target=lambda: asyncio.run(self.pull()), name="test-async-worker",
                                       daemon=True)
        self.thread.start()

    async def pull(self):
        while self.running:
            if self.done.qsize() < self.batch:
                for group in self.data_source.get_samples(1):
                    for s in group:
                        s.append_response_tokens(None, tokens=[9], log_probs=[-1.0],
                                                 meta_info={"finish_reason": {"type": "stop"}, "weight_version": "0"})
                        s.reward = 1.0
                    self.done.put(group)
            await asyncio.sleep(0.01)

    def stop(self):
        self.running = False
        self.thread.join(5)


def stop_worker():
    while WORKERS:
        WORKERS.pop().stop()


atexit.register(stop_worker)


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    if not WORKERS:
        WORKERS.append(Worker(data_source, args.rollout_batch_size))
    CALLS.append((rollout_id, WORKERS[0]))
    if FAIL:
        raise RuntimeError(FAIL.pop())
    groups = [WORKERS[0].done.get(timeout=10) for _ in range(args.rollout_batch_size)]
    return RolloutFnTrainOutput(samples=groups)


FAIL = []
'''


def load_worker_function(tmp_path, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(FULLY_ASYNC))
    return load_function(f"{path}:generate_rollout", "rollout.slime.rollout_function")


def worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("test-async-worker", "slime-rollout-calls")]


async def ask(calls: RolloutCalls, n: int) -> list:
    return await asyncio.gather(*(calls.next_group({"prompt_tokens": [i]}) for i in range(n)))


def test_a_whole_rollout_function_is_called_once_per_step_keeps_its_worker_and_is_stopped_by_its_exit_hook(tmp_path):
    fn = load_worker_function(tmp_path, "worker_kept")
    module = sys.modules[fn.__module__]
    source, drawn = prompts_source()
    args = types.SimpleNamespace(rollout_batch_size=2)
    calls = RolloutCalls(fn, args, source, fleet=Fleet(router_url="http://127.0.0.1:1"), where="test function")

    async def two_steps() -> list:
        return [await ask(calls, 2), await ask(calls, 2)]

    steps = asyncio.run(two_steps())
    assert [rollout_id for rollout_id, _ in module.CALLS] == [0, 1] and calls.calls == 2
    assert module.CALLS[0][1] is module.CALLS[1][1]  # one worker across calls: its queue stays warm
    groups = [group for step in steps for group, _answers in step]
    assert [[s.group_index for s in g] for g in groups] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert [g[0].tokens for g in groups[:2]] == [[0, 9], [1, 9]]  # the prompts the steps admitted come first
    assert sorted(worker_threads()) == ["slime-rollout-calls", "test-async-worker"]
    calls.close(wait_s=5)
    assert worker_threads() == [] and module.WORKERS == []


def test_a_worker_keeps_the_runs_fleet_until_its_exit_hook_has_stopped_it(tmp_path):
    """A worker still posting at the run's end authenticates until its exit hook stops it (no 401s at shutdown)."""
    fn = load_worker_function(tmp_path, "worker_fleet")
    module = sys.modules[fn.__module__]
    fleet, seen, stop = Fleet(router_url="http://127.0.0.1:1", api_key="k"), [], module.Worker.stop

    def stop_seeing_the_fleet(worker):  # what `post` would use from the worker's thread as the hook stops it
        probe = threading.Thread(target=lambda: seen.append(http_calls.current_fleet()))
        probe.start(), probe.join()
        stop(worker)

    module.Worker.stop = stop_seeing_the_fleet
    calls = RolloutCalls(fn, types.SimpleNamespace(rollout_batch_size=1), prompts_source()[0], fleet=fleet,
                         where="test function")
    asyncio.run(ask(calls, 1))
    calls.close(wait_s=5)
    assert seen == [fleet] and http_calls.current_fleet() is None and worker_threads() == []


def test_a_worker_still_draining_after_its_exit_hook_keeps_the_fleet_until_its_thread_ends(tmp_path):
    fn = load_worker_function(tmp_path, "worker_draining")
    module = sys.modules[fn.__module__]
    fleet, drained = Fleet(router_url="http://127.0.0.1:1", api_key="k"), threading.Event()

    def stop_without_waiting(worker):  # slime's worker: its hook waits 5 s, its loop drains for up to 30 s
        worker.running = False
        worker.thread.join(0.05)

    module.Worker.stop = stop_without_waiting
    module.Worker.pull_done = module.Worker.pull
    module.Worker.pull = lambda worker: _drain_after(worker, drained)
    calls = RolloutCalls(fn, types.SimpleNamespace(rollout_batch_size=1), prompts_source()[0], fleet=fleet,
                         where="test function")
    asyncio.run(ask(calls, 1))
    calls.close(wait_s=5)
    assert http_calls.current_fleet() is fleet and worker_threads() == ["test-async-worker"]
    drained.set()
    for thread in [t for t in threading.enumerate() if t.name in ("test-async-worker", "slime-fleet-release")]:
        thread.join(5)
    assert http_calls.current_fleet() is None and worker_threads() == []


async def _drain_after(worker, drained: threading.Event) -> None:
    await worker.pull_done()
    await asyncio.to_thread(drained.wait, 5)


def test_a_failing_call_fails_the_groups_waiting_and_the_next_ask_calls_again(tmp_path):
    fn = load_worker_function(tmp_path, "worker_failing")
    module = sys.modules[fn.__module__]
    module.FAIL.append("the retriever is down")
    source, _ = prompts_source()
    calls = RolloutCalls(fn, types.SimpleNamespace(rollout_batch_size=2), source,
                         fleet=Fleet(router_url="http://127.0.0.1:1"), where="test function")

    async def asks() -> tuple:
        failed = await asyncio.gather(*(calls.next_group({"prompt_tokens": [i]}) for i in range(2)),
                                      return_exceptions=True)
        return failed, await ask(calls, 2)

    try:
        failed, served = asyncio.run(asks())
    finally:
        calls.close(wait_s=5)
    assert [str(f) for f in failed] == ["the retriever is down"] * 2
    assert len(served) == 2 and [rollout_id for rollout_id, _ in module.CALLS] == [0, 1]
    assert worker_threads() == []


def test_a_group_its_asker_gave_up_on_serves_the_next_asker(tmp_path):
    fn = load_worker_function(tmp_path, "worker_given_up")
    source, _ = prompts_source()
    calls = RolloutCalls(fn, types.SimpleNamespace(rollout_batch_size=1), source,
                         fleet=Fleet(router_url="http://127.0.0.1:1"), where="test function")

    async def asks() -> list:
        first = asyncio.ensure_future(calls.next_group({"prompt_tokens": [1]}))
        first.cancel()  # its group timed out
        await asyncio.gather(first, return_exceptions=True)
        return await ask(calls, 1)

    try:
        [(group, _)] = asyncio.run(asks())
    finally:
        calls.close(wait_s=5)
    assert group[0].group_index == 0 and calls.calls <= 2


def test_the_adapter_takes_groups_from_the_calls_and_generates_eval_groups_per_sample(tmp_path, text_model_dir):
    fn = load_worker_function(tmp_path, "worker_adapted")
    fns = SlimeFunctions(client=None, model_path=text_model_dir, sampling_params={"max_new_tokens": 4},
                         samples_per_prompt=2, prompts_per_step=1, seed=0, rollout_function=f"{fn.__code__.co_filename}"
                         ":generate_rollout", generate_function="test_slime_rollout.generate_two_tokens",
                         reward_function="test_slime_rollout.reward_by_index")
    source_prompts = iter({"prompt_tokens": [50 + i]} for i in range(100))
    ctx = types.SimpleNamespace(group_id=4, max_resumes=0, sampling_for=lambda i: {"max_new_tokens": 4},
                                draw_prompt=lambda: next(source_prompts))
    try:
        samples = asyncio.run(fns.generate_group(ctx, {"prompt_tokens": [1, 2], "label": "x"}, 2))
        assert [(s.prompt_tokens, s.response_tokens, s.versions, s.reward, s.group_id, s.index) for s in samples] == \
            [([1, 2], [9], [0], 1.0, 4, i) for i in range(2)]
        CALLS.clear()
        ctx.group_id = -1  # an eval group: per sample, through the generate function, evaluation on
        evaluated = asyncio.run(fns.generate_group(ctx, {"prompt_tokens": [1, 2]}, 2))
        assert [(s.response_tokens, s.reward) for s in evaluated] == [([7, 8], 0.0), ([7, 8], 1.0)]
        assert [c["fn"] for c in CALLS].count("generate") == 2
    finally:
        fns.close()
    assert worker_threads() == []
