"""How a run wires text tasks and evaluation from its config: the policy's directory as the default tokenizer, the
tiny model with a tokenizer, the eval section (defaults, validation, the eval task), the data file the arithmetic
task writes when it is missing, and the per-step metrics of dict rewards and task filters."""
from __future__ import annotations

import json

import pytest

from glue.loop.batch import rollout_metrics
from glue.types import Group, Sample
from launch.config import ConfigError, load_config
from launch.run.runner import make_evaluator
from launch.run.tasks import eval_task, task_args_for, task_metrics

TEXT_TASK = "rollout_fns.text_data:TextDataTask"


def test_a_task_that_takes_a_tokenizer_gets_the_policy_directory_unless_it_names_one():
    assert task_args_for(TEXT_TASK, {"path": "a.jsonl"}, "/m") == {"path": "a.jsonl", "tokenizer": "/m"}
    assert task_args_for(TEXT_TASK, {"path": "a.jsonl", "tokenizer": "/t"}, "/m")["tokenizer"] == "/t"
    assert task_args_for("rollout_fns.arith_text:ArithTextTask", {}, "/m") == {"tokenizer": "/m"}
    assert task_args_for("rollout_fns.toy_tasks:EchoTask", {"k": 2}, "/m") == {"k": 2}  # takes no tokenizer


def test_a_task_counting_filtered_prompts_reports_them_and_others_report_nothing():
    class Filtering:
        filtered_prompts = 3

    assert task_metrics(Filtering()) == {"rollout/filtered_prompts": 3.0}
    assert task_metrics(object()) == {}


def test_extra_keys_of_dict_rewards_become_reward_metrics():
    samples = [Sample(prompt_tokens=[1], reward={"score": 1.0, "correct": 1.0, "format_ok": 0.0}, index=0),
               Sample(prompt_tokens=[1], reward={"score": -0.5, "correct": 0.0, "format_ok": 1.0}, index=1)]
    for s in samples:
        s.append_response([2], [-1.0], 0)
    m = rollout_metrics([Group(group_id=0, samples=samples)])
    assert m["rollout/reward_mean"] == pytest.approx(0.25)
    assert m["reward/correct"] == pytest.approx(0.5) and m["reward/format_ok"] == pytest.approx(0.5)
    assert "reward/score" not in m


def test_eval_is_off_by_default_and_its_task_defaults_to_the_training_task_with_its_args_updated():
    cfg = load_config("examples/configs/demo.yaml")
    assert not cfg.eval.enabled and make_evaluator(cfg, fn=None, client=None, model_path="/m") is None
    cfg = load_config(None, ["rollout.task=" + TEXT_TASK, "rollout.task_args={path: train.jsonl, shuffle: false}",
                             "eval.interval=5", "eval.task_args={path: test.jsonl}"])
    assert eval_task(cfg) == (TEXT_TASK, {"path": "test.jsonl", "shuffle": False})
    cfg = load_config(None, ["eval.interval=5", "eval.task=rollout_fns.toy_tasks:EchoTask", "eval.task_args={k: 2}"])
    assert eval_task(cfg) == ("rollout_fns.toy_tasks:EchoTask", {"k": 2})


def test_eval_sampling_may_be_greedy_and_takes_unset_fields_from_the_training_sampling():
    cfg = load_config(None, ["eval.interval=2", "rollout.sampling.max_new_tokens=5", "eval.sampling.top_p=0.5"])
    assert cfg.eval.sampling.to_sglang(cfg.rollout.sampling.to_sglang()) == {
        "temperature": 0.0, "top_p": 0.5, "top_k": -1, "max_new_tokens": 5}
    with pytest.raises(ConfigError, match="rollout.sampling.temperature must be > 0"):
        load_config(None, ["rollout.sampling.temperature=0"])


@pytest.mark.parametrize("override,message", [
    ("eval.pass_at_k=[1, 4]", r"eval.pass_at_k entries must be integers in \[1, eval.samples_per_prompt=2\], got \[4\]"),
    ("eval.num_prompts=0", "eval.num_prompts must be >= 1"),
    ("eval.sampling.temperature=-1", "eval.sampling.temperature must be >= 0"),
    ("eval.intervall=3", "did you mean 'eval.interval'"),
    ("rollout.max_filtered_frac=1", r"rollout.max_filtered_frac must be in \[0, 1\)"),
    ("model.tiny.tokenizer=true", "model.tiny.vocab_size must be >= 260 with model.tiny.tokenizer=true"),
])
def test_bad_eval_dynamic_sampling_and_tiny_tokenizer_settings_fail_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["eval.samples_per_prompt=2", override])


def test_the_text_arith_recipe_resolves_with_eval_and_a_tiny_tokenizer():
    cfg = load_config("examples/configs/text_arith.yaml")
    assert cfg.model.tiny.tokenizer and cfg.model.path is None
    assert cfg.eval.enabled and cfg.eval.at_start and cfg.eval.pass_at_k
    assert cfg.rollout.task_args["reward"] == "rollout_fns.verifiers:math_reward"


def test_a_tiny_model_with_a_tokenizer_is_written_into_the_run_folder_and_the_arith_task_writes_its_data(tmp_path):
    from transformers import AutoTokenizer

    from launch.run.folder import prepare_model
    from rollout_fns.arith_text import ArithTextTask

    cfg = load_config("examples/configs/text_arith.yaml", [f"run.output_dir={tmp_path}"])
    model_path = prepare_model(cfg, cfg.run_dir)
    assert model_path == str((tmp_path / "text_arith" / "init_model").resolve())
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    assert len(tokenizer) == cfg.model.tiny.vocab_size and tokenizer.chat_template
    data = tmp_path / "data" / "train.jsonl"
    task = ArithTextTask(**task_args_for("rollout_fns.arith_text:ArithTextTask",
                                         {"path": str(data), "num_rows": 12, "high": 3}, model_path))
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 12 and all(0 <= int(r["answer"]) <= 6 for r in rows)
    prompt = next(iter(task.prompts(0)))
    assert tokenizer.decode(prompt["prompt_tokens"]).endswith("<|im_start|>assistant\n")
    data.write_text(json.dumps({"prompt": "What is 1+1?", "answer": "2"}) + "\n")  # an existing file is read as is
    assert len(ArithTextTask(path=str(data), tokenizer=model_path).rows) == 1


def test_with_colocated_placement_eval_steps_must_be_sync_steps():
    from launch.run.preflight import check_eval

    cfg = load_config(None, ["eval.interval=3", "sync.interval=2", "sync.max_staleness=1"])
    check_eval(cfg, "disaggregated")  # engines keep their weights between syncs
    with pytest.raises(ConfigError, match="eval.interval=3 must be a multiple of sync.interval=2"):
        check_eval(cfg, "colocated")
    check_eval(load_config(None, ["eval.interval=4", "sync.interval=2", "sync.max_staleness=1"]), "colocated")
