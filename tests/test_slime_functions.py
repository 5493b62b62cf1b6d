"""slime's rollout and reward functions run unchanged (rollout.slime.*, reward.slime.function): a multi-turn,
tool-calling generate function written the way slime's examples write them (it imports slime's modules, posts to the
router's /generate, appends tool tokens with loss_mask 0) and a reward function in slime's signature train for two
steps through a whole run (Ray, embedded engines behind the real sgl-router, megatron on gloo), sync and async; their
samples reach the trainer with the engine's tokens and logprobs and a weight version on every response token."""
from __future__ import annotations

import asyncio
import math
import sys
from types import SimpleNamespace

import pytest

from glue.loop.replay import load_step
from glue.metrics.logger import read_metrics
from glue.rollout.slime import shim
from glue.rollout.slime.adapter import load_slime_functions, token_versions
from glue.rollout.slime.http_calls import GenerateCall
from glue.rollout.slime.sample import Sample as SlimeSample
from glue.types import SampleStatus
from launch.config import ConfigError, load_config
from launch.run.runner import run
from rollout_fns.arith_data import write_arith_jsonl

shim.install()  # what sluice does before loading a slime function; slime itself is not installed here

from slime.rollout.sglang_rollout import GenerateState  # noqa: E402 - the stand-in installed above
from slime.utils.http_utils import post  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

TOOL_OPEN, TOOL_CLOSE = "<tool_response>", "</tool_response>"
SEEN: list[dict] = []  # what the reward function was given, by run


# --- the user's code, in slime's style ----------------------------------------------------------------------------

def run_tool(call_text: str) -> str:
    """The tool: a calculator on the digits of the call (a tiny random model writes no real call)."""
    return str(sum(int(ch) for ch in call_text if ch.isdigit()))


async def generate_with_tool(args, sample: Sample, sampling_params) -> Sample:
    """Turn 1, a tool call whose answer is appended as tool tokens (loss_mask 0), then turn 2."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = list(sample.tokens)
    response, response_ids, loss_mask, log_probs = "", [], [], []
    for turn in range(2):
        payload = {"input_ids": prompt_ids + response_ids, "sampling_params": sampling_params, "return_logprob": True}
        output = await post(url, payload)
        finish = output["meta_info"]["finish_reason"]["type"]
        if finish == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        ids = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        text = output.get("text") or state.tokenizer.decode(ids)
        response += text
        response_ids += ids
        loss_mask += [1] * len(ids)
        log_probs += [item[0] for item in output["meta_info"]["output_token_logprobs"]]
        if turn == 1:
            break
        observation = f"{TOOL_OPEN}{run_tool(text)}{TOOL_CLOSE}"
        obs_ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        response += observation
        response_ids += obs_ids
        loss_mask += [0] * len(obs_ids)
        log_probs += [0.0] * len(obs_ids)
    sample.tokens = prompt_ids + response_ids
    sample.response = response
    sample.response_length = len(response_ids)
    sample.loss_mask = loss_mask
    sample.rollout_log_probs = log_probs
    sample.status = Sample.Status.TRUNCATED if finish == "length" else Sample.Status.COMPLETED
    return sample


async def reward_func(args, sample, **kwargs):
    """The share of digits in the answer after the tool's, plus 1 when it holds the label."""
    if not isinstance(sample, Sample):
        raise TypeError("Sample must be an instance of Sample class.")
    answer = sample.response.split(TOOL_CLOSE)[-1]
    SEEN.append({"label": sample.label, "has_tool": TOOL_CLOSE in sample.response,
                 "masked": sample.loss_mask.count(0), "router": (args.sglang_router_ip, args.sglang_router_port)})
    return sum(ch.isdigit() for ch in answer) / max(1, len(answer)) + float(str(sample.label) in answer)


# --- whole runs ----------------------------------------------------------------------------------------------------

def slime_run(tmp_path, mode: str):
    data = write_arith_jsonl(tmp_path / "arith.jsonl", 32, seed=1)
    cfg = load_config("examples/configs/demo.yaml", [
        f"run.output_dir={tmp_path}", f"run.name={mode}", "run.num_steps=2", f"run.mode={mode}",
        "run.save_rollouts=true", "model.tiny.tokenizer=true", "model.tiny.vocab_size=272",
        "rollout.task=rollout_fns.text_data:TextDataTask", f"rollout.task_args.path={data}",
        "rollout.task_args.prompt_key=prompt", "rollout.task_args.label_key=answer",
        "rollout.slime.generate_function=test_slime_functions:generate_with_tool",
        "reward.slime.function=test_slime_functions:reward_func", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.sampling.max_new_tokens=6", "rollout.num_engines=1"])
    assert cfg.rollout.function == "rollout_fns.slime_functions:generate_group"
    SEEN.clear()
    run_dir = run(cfg)
    return run_dir, read_metrics(run_dir / "metrics.jsonl")


def check_trained_samples(run_dir, records, max_staleness: int) -> None:
    assert [r["step"] for r in records] == [1, 2] and [r["weights/version"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/num_samples"] == 8 and r["rollout/failed"] == 0, r
    # the trainer's logprobs of the kept tokens are the engine's, and no tool token is trained: on every step in sync
    # mode, on the first in async (later steps train tokens of the weights before, which the trainer no longer holds)
    for r in records[:1] if max_staleness else records:
        assert math.isclose(r["train/discrepancy/ratio_mean"], 1.0, abs_tol=1e-3), r
    assert len(SEEN) >= 16 and all(s["has_tool"] and s["masked"] > 0 and s["label"] for s in SEEN), SEEN[:2]
    for step in (1, 2):
        groups, _ = load_step(run_dir, step)
        for sample in (s for g in groups for s in g.samples):
            tool = sample.metadata["response_text"].index(TOOL_OPEN)
            assert tool > 0 and sample.loss_mask.count(0) > 0
            first_masked = sample.loss_mask.index(0)
            assert all(m == 0 for m in sample.loss_mask[first_masked:first_masked + 3])
            assert len(sample.versions) == len(sample.response_tokens) and "unrecorded_version_tokens" not in \
                sample.metadata
            assert 0 <= step - 1 - min(sample.versions) <= max_staleness, (step, sample.versions)
            assert sample.reward == pytest.approx(reward_of(sample))


def reward_of(sample) -> float:
    answer = sample.metadata["response_text"].split(TOOL_CLOSE)[-1]
    return sum(ch.isdigit() for ch in answer) / max(1, len(answer)) + float(sample.metadata["label"] in answer)


@pytest.mark.slow
@pytest.mark.long  # a second variant: tests/test_slime_search_r1.py trains a slime-shaped function in CI
def test_a_slime_generate_and_reward_function_train_two_sync_steps_unchanged(tmp_path):
    run_dir, records = slime_run(tmp_path, "sync")
    check_trained_samples(run_dir, records, max_staleness=0)
    assert {s["router"][0] for s in SEEN} == {"127.0.0.1"}


@pytest.mark.slow
@pytest.mark.long  # a second whole run (the sync one stays in make test)
def test_a_slime_generate_and_reward_function_train_two_async_steps_unchanged(tmp_path):
    run_dir, records = slime_run(tmp_path, "async")
    check_trained_samples(run_dir, records, max_staleness=1)


# --- the adapter's pieces ------------------------------------------------------------------------------------------

def test_tool_tokens_take_the_version_of_the_turn_before_and_recorded_answers_stamp_their_own():
    sample = SlimeSample(tokens=[1, 2, 10, 11, 50, 51, 12, 13], response_length=6)
    calls = [GenerateCall(input_len=2, output_ids=[10, 11], versions=[3, 4]),
             GenerateCall(input_len=6, output_ids=[12, 13], versions=[5, 5]),
             GenerateCall(input_len=2, output_ids=[99], versions=[9])]  # another sample's answer
    assert token_versions(sample, calls) == [3, 4, 4, 4, 5, 5]
    assert token_versions(sample, []) is None  # the adapter then takes the engines' version at the group's start


def test_a_function_that_records_no_version_gets_the_engines_version_at_the_group_start():
    from glue.rollout.slime.adapter import SlimeFunctions

    async def unrecorded(args, sample, sampling_params):
        sample.tokens += [5, 6]
        sample.response_length, sample.rollout_log_probs, sample.reward = 2, [-1.0, -1.0], 1.0
        sample.status = Sample.Status.COMPLETED
        return sample

    class Engines:
        router_url, answers = "http://127.0.0.1:1", [["4", "3"]]

        def weight_versions(self):
            return self.answers.pop(0)

    sys.modules["slime_unrecorded_for_test"] = SimpleNamespace(generate=unrecorded)
    ctx = SimpleNamespace(group_id=0, max_resumes=0, sampling_for=lambda i: {"max_new_tokens": 4})
    fns = SlimeFunctions(client=Engines(), model_path="/nonexistent", sampling_params={"max_new_tokens": 4},
                         samples_per_prompt=2, prompts_per_step=1, seed=0,
                         generate_function="slime_unrecorded_for_test:generate")
    samples = asyncio.run(fns.generate_group(ctx, {"prompt_tokens": [1]}, 2))
    assert [(s.versions, s.metadata["unrecorded_version_tokens"]) for s in samples] == [([3, 3], 2)] * 2
    Engines.answers = []  # the engines cannot say: the group fails naming the way out
    with pytest.raises(ValueError, match="no weight version is known .* slime.utils.http_utils.post"):
        asyncio.run(fns.generate_group(ctx, {"prompt_tokens": [1]}, 2))


def test_append_response_tokens_keeps_slime_s_fields_and_stamps_versions_from_meta_info():
    s = SlimeSample(tokens=[1, 2])
    meta = {"finish_reason": {"type": "length"}, "weight_version": "2",
            "weight_versions": [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 2}]}
    s.append_response_tokens(None, tokens=[7, 8], log_probs=[-0.5, -0.25], meta_info=meta, text="ab")
    s.append_response_tokens(None, tokens=[9], trainable=False)
    assert (s.tokens, s.response, s.response_length, s.loss_mask) == ([1, 2, 7, 8, 9], "ab", 3, [1, 1, 0])
    assert (s.rollout_log_probs, s.token_versions, s.weight_versions) == ([-0.5, -0.25, 0.0], [1, 2, 2], ["2"])
    assert s.status is SlimeSample.Status.TRUNCATED and s.effective_response_length == 2
    with pytest.raises(ValueError, match="trainable response tokens require rollout log probabilities"):
        s.append_response_tokens(None, tokens=[1])


def test_append_response_tokens_extends_the_lists_a_function_holds_in_place_as_slime_does():
    s = SlimeSample(tokens=[1, 2])
    s.append_response_tokens(None, tokens=[7], log_probs=[-0.5])
    tokens, loss_mask, log_probs = s.tokens, s.loss_mask, s.rollout_log_probs  # retool keeps such references
    s.append_response_tokens(None, tokens=[8, 9], trainable=False)
    assert loss_mask is s.loss_mask and loss_mask == [1, 0, 0]
    assert tokens is s.tokens and tokens == [1, 2, 7, 8, 9]
    assert log_probs is s.rollout_log_probs and log_probs == [-0.5, 0.0, 0.0]


def test_the_functions_args_carry_what_the_run_sets_and_slimes_defaults_otherwise():
    from glue.rollout.slime.adapter import slime_args
    from launch.run.components import make_slime_functions

    defaults = slime_args(router_url="http://127.0.0.1:1", model_path="/m", sampling_params={"max_new_tokens": 4},
                          samples_per_prompt=2, prompts_per_step=1, seed=0, generate_path=None, reward_path=None)
    assert (defaults.rollout_max_context_len, defaults.eval_max_context_len, defaults.rm_type,
            defaults.context_parallel_size, defaults.max_tokens_per_gpu) == (None, None, None, 1, None)
    cfg = load_config("examples/configs/demo.yaml", [
        "rollout.slime.generate_function=test_slime_functions:generate_with_tool",
        "rollout.slime.max_context_len=512", "rollout.slime.rm_type=deepscaler",
        "trainer.max_tokens_per_micro_batch=2048"])
    args = make_slime_functions(cfg, None, "/nonexistent").args
    assert (args.rollout_max_context_len, args.eval_max_context_len, args.rm_type, args.context_parallel_size,
            args.max_tokens_per_gpu) == (512, 512, "deepscaler", 1, 2048)
    with pytest.raises(ConfigError, match="rollout.slime.max_context_len must be an integer >= 2"):
        load_config("examples/configs/demo.yaml", ["rollout.slime.max_context_len=1"])


def test_a_returned_sample_that_does_not_line_up_is_refused_naming_the_field():
    from glue.rollout.slime.sample import to_sluice

    good = SlimeSample(tokens=[1, 2, 3], response_length=1, rollout_log_probs=[-1.0],
                       status=SlimeSample.Status.COMPLETED, reward=1.0, label="3")
    converted = to_sluice(good, versions=[4], group_id=2, index=1, where="f")
    assert (converted.prompt_tokens, converted.response_tokens, converted.loss_mask, converted.versions) == \
        ([1, 2], [3], [1], [4])
    assert converted.status is SampleStatus.COMPLETED and converted.metadata["label"] == "3"
    for change, message in [({"rollout_log_probs": None}, "rollout_log_probs is None; post /generate with"),
                            ({"loss_mask": [1, 1]}, "loss_mask has 2 entries for response_length=1"),
                            ({"response_length": 3}, "response_length=3 but sample.tokens has 3 entries"),
                            ({"status": SlimeSample.Status.PENDING}, "came back with status PENDING")]:
        with pytest.raises(ValueError, match=message):
            to_sluice(SlimeSample(**{**vars(good), **change}), versions=[4], group_id=0, index=0, where="f")


def test_slime_function_paths_load_by_module_or_file_and_bad_ones_fail_in_one_line(tmp_path):
    generate, rollout, reward = load_slime_functions("test_slime_functions.generate_with_tool", None,
                                                     "test_slime_functions:reward_func")
    assert (generate, rollout, reward) == (generate_with_tool, None, reward_func)
    user = tmp_path / "my_rollout.py"
    user.write_text("from slime.utils.types import Sample\n\n"
                    "def generate_rollout(args, rollout_id, data_source, evaluation=False):\n    return []\n\n"
                    "def not_async(args, sample, sampling_params):\n    return sample\n\n"
                    "async def two_args(args, sample):\n    return 0.0\n")
    _, rollout, _ = load_slime_functions(None, f"{user}:generate_rollout", None)
    assert rollout.__name__ == "generate_rollout"
    for paths, message in [
            ((f"{tmp_path}/nope.py:generate", None, None), "rollout.slime.generate_function: .* no such file"),
            ((f"{user}:missing", None, None), "has no function 'missing'"),
            ((f"{user}:not_async", None, None), "must be an async function: `async def generate"),
            ((f"{user}:two_args", None, None), r"two_args\(args, sample\) does not fit slime's"),
            ((None, None, "no_such_pkg.rm:reward"), "reward.slime.function: cannot load .* not found"),
            (("test_slime_functions:generate_with_tool", f"{user}:two_args", None), "is another; keep one")]:
        with pytest.raises((ValueError, TypeError, ImportError, AttributeError, FileNotFoundError), match=message):
            load_slime_functions(*paths)


def test_the_slime_keys_make_the_adapter_the_rollout_function_and_conflicts_are_refused():
    cfg = load_config(None, ["rollout.slime.rollout_function=pkg.mod:generate", "reward.slime.function=pkg.rm:f"])
    assert cfg.rollout.function == "rollout_fns.slime_functions:generate_group"
    assert cfg.reward.slime.function == "pkg.rm:f"
    with pytest.raises(ConfigError, match="rollout.slime.generate_function is the rollout function, so "
                                          "rollout.function='rollout_fns.multi_turn:generate_group' cannot apply"):
        load_config(None, ["rollout.slime.generate_function=pkg.mod:g",
                           "rollout.function=rollout_fns.multi_turn:generate_group"])
    with pytest.raises(ConfigError, match="set rollout.slime.generate_function or rollout.slime.rollout_function"):
        load_config(None, ["rollout.function=rollout_fns.slime_functions:generate_group"])


def test_the_docs_slime_config_names_the_adapter_and_the_reward(tmp_path):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "rollout_functions.md").read_text()
    section = text[text.index("## 4. slime functions"):]
    snippet = section[section.index("```yaml") + len("```yaml"):]
    (tmp_path / "run.yaml").write_text(snippet[:snippet.index("```")])
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.rollout.function == "rollout_fns.slime_functions:generate_group"
    assert (cfg.rollout.slime.generate_function, cfg.reward.slime.function) == \
        ("generate_with_retool.generate", "generate_with_retool.reward_func")


def test_a_slime_reward_function_scores_sluice_s_own_samples_with_texts_and_label(text_model_dir, tokenizer):
    from glue.rollout.slime.adapter import SlimeFunctions
    from glue.types import Sample as SluiceSample

    fns = SlimeFunctions(client=None, model_path=text_model_dir, sampling_params={"max_new_tokens": 4},
                         samples_per_prompt=2, prompts_per_step=1, seed=0,
                         reward_function="test_slime_functions:reward_func")
    prompt, answer = tokenizer("What is 2+2?").input_ids, tokenizer(" it is 4").input_ids
    sample = SluiceSample(prompt_tokens=prompt, metadata={"label": "4"})
    sample.append_response(answer, [-1.0] * len(answer), version=0)
    SEEN.clear()
    assert asyncio.run(fns.reward(sample)) == pytest.approx(1 / 8 + 1.0)  # one digit in " it is 4", and the label
    assert SEEN[0]["label"] == "4" and SEEN[0]["masked"] == 0


def test_dry_run_refuses_a_slime_function_path_that_does_not_load_in_one_line(capsys, tmp_path):
    from launch.cli import main

    argv = ["--dry-run", "--config", "examples/configs/demo.yaml"]
    assert main([*argv, f"rollout.slime.generate_function={tmp_path}/gen.py:generate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"rollout.slime.generate_function: '{tmp_path}/gen.py:generate': no such file" in err[0]
    assert main([*argv, "rollout.slime.generate_function=test_slime_functions:generate_with_tool",
                 "reward.slime.function=test_slime_functions:reward_func"]) == 0
    assert "slime functions test_slime_functions:generate_with_tool, test_slime_functions:reward_func fit" in \
        capsys.readouterr().out
    assert main([*argv, "rollout.slime.generate_function=test_slime_functions:generate_with_tool",
                 "rollout.return_routed_experts=true"]) == 2
    assert "rollout.return_routed_experts: slime functions post /generate themselves" in capsys.readouterr().err
