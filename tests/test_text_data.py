"""The text data-set task and the tiny text model it runs with: loading JSONL / Parquet, refusing bad rows by
file:line, chat templating exactly as the tokenizer does, filtering, epochs, skipping, and rewards."""
from __future__ import annotations

import asyncio
import itertools
import json
import re
from pathlib import Path

import pytest

from glue.types import Sample
from rollout_fns.arith_data import arith_rows, write_arith_jsonl
from rollout_fns.text_data import TextDataTask, load_rows


@pytest.fixture
def arith_path(tmp_path) -> str:
    return write_arith_jsonl(tmp_path / "arith.jsonl", 20, seed=1)


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


# --- the tiny text model ---------------------------------------------------------------------------------------

def test_tiny_text_model_loads_offline_and_generates(text_model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(text_model_dir, local_files_only=True)
    assert len(tokenizer) == model.config.vocab_size == 512
    assert (model.config.bos_token_id, model.config.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = chat_ids(tokenizer, [{"role": "user", "content": "What is 12+7?"}])
    out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert out.shape == (1, len(prompt) + 6)
    assert out[0, : len(prompt)].tolist() == prompt


def test_tiny_text_model_chat_template_is_chatml(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


def test_autotokenizer_encodes_like_the_trained_tokenizer_file(text_model_dir, tokenizer):
    """AutoTokenizer picks Qwen2Tokenizer for a qwen2 config and rebuilds the pipeline from vocab and merges; the
    ids must still be those of tokenizer.json, which SGLang or any other reader may load directly."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(Path(text_model_dir) / "tokenizer.json"))
    for text in ["What is 123+456?", "So \\boxed{\\frac{1}{2}}.  Done\n\nnext", "<|im_start|>user\nhi<|im_end|>"]:
        assert tokenizer(text, add_special_tokens=False).input_ids == raw.encode(text).ids
    assert tokenizer.decode(tokenizer("\\boxed{19}").input_ids) == "\\boxed{19}"


def test_tiny_text_model_is_the_same_for_a_seed_and_differs_across_seeds(tmp_path):
    from glue.embedded_engine.tiny_text_model import save_tiny_text_model

    a, b, c = (Path(save_tiny_text_model(tmp_path / name, seed=seed)) for name, seed in [("a", 3), ("b", 3), ("c", 4)])
    for name in ["tokenizer.json", "model.safetensors", "config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


# --- loading ---------------------------------------------------------------------------------------------------

def test_jsonl_prompts_are_chat_templated_exactly_as_the_tokenizer_does(arith_path, text_model_dir, tokenizer):
    task = TextDataTask(path=arith_path, tokenizer=text_model_dir, shuffle=False)
    rows = arith_rows(20, seed=1)
    for prompt, row in zip(itertools.islice(task.prompts(seed=0), 3), rows):
        assert prompt["prompt_tokens"] == chat_ids(tokenizer, [{"role": "user", "content": row["prompt"]}])
        assert prompt["label"] == row["answer"]


def test_parquet_rows_load_like_jsonl_rows(tmp_path, text_model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = arith_rows(5, seed=2)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "arith.parquet")
    from_parquet = load_rows(tmp_path / "arith.parquet")
    from_jsonl = load_rows(write_arith_jsonl(tmp_path / "arith.jsonl", 5, seed=2))
    assert from_parquet == from_jsonl
    assert [r.label for r in from_parquet] == [r["answer"] for r in rows]


def test_system_prompt_goes_first_and_message_prompts_keep_their_own(tmp_path, text_model_dir, tokenizer):
    messages = [{"role": "system", "content": "Own system."}, {"role": "user", "content": "What is 2+2?"}]
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "What is 1+1?", "answer": "2"}),
                                              json.dumps({"prompt": messages, "answer": "4"})])
    task = TextDataTask(path=path, tokenizer=text_model_dir, system_prompt="Box it.", shuffle=False)
    text_prompt, message_prompt = itertools.islice(task.prompts(seed=0), 2)
    assert text_prompt["prompt_tokens"] == chat_ids(tokenizer, [{"role": "system", "content": "Box it."},
                                                                {"role": "user", "content": "What is 1+1?"}])
    assert message_prompt["prompt_tokens"] == chat_ids(tokenizer, messages)


def test_without_chat_template_the_plain_text_is_tokenized(arith_path, text_model_dir, tokenizer):
    task = TextDataTask(path=arith_path, tokenizer=text_model_dir, apply_chat_template=False, shuffle=False)
    prompt = next(iter(task.prompts(seed=0)))
    assert prompt["prompt_tokens"] == tokenizer(arith_rows(1, seed=1)[0]["prompt"]).input_ids


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": '], "d.jsonl:2: invalid JSON"),
    (['{"prompt": "a", "answer": "1"}', "", '{"prompt": "b"}'], "d.jsonl:3: missing key 'answer'"),
    (['{"prompt": 5, "answer": "1"}'], "d.jsonl:1: 'prompt' must be a string or a list of chat messages, got int"),
    (['["a", "1"]'], "d.jsonl:1: expected an object"),
    (['{"prompt": [{"role": "user"}], "answer": "1"}'], "d.jsonl:1: 'prompt' message 0 must be an object"),
])
def test_bad_jsonl_rows_are_refused_naming_file_and_line(tmp_path, lines, message):
    with pytest.raises(ValueError) as err:
        load_rows(write_lines(tmp_path / "d.jsonl", lines))
    assert str(err.value).startswith(f"{tmp_path}/{message}")


def test_labels_of_any_json_type_are_kept_as_the_row_holds_them(tmp_path):
    labels = ["19", 19, 0.5, {"ground_truth": {"target": ["Paris"]}}, ["a", "b"], False]
    lines = [json.dumps({"prompt": f"q{i}", "reward_model": label}) for i, label in enumerate(labels)]
    rows = load_rows(write_lines(tmp_path / "d.jsonl", lines), label_key="reward_model")
    assert [row.label for row in rows] == labels
    assert rows[3].label["ground_truth"]["target"] == ["Paris"]


def test_a_dict_label_reaches_the_reward_function_as_a_dict(tmp_path, text_model_dir, tokenizer):
    label = {"ground_truth": {"target": ["19"]}}
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "What is 12+7?", "reward_model": label})])
    task = TextDataTask(path=path, tokenizer=text_model_dir, label_key="reward_model",
                        reward="tests.test_text_data:ground_truth_reward")
    prompt = next(iter(task.prompts(seed=0)))
    tokens = tokenizer("It is 19", add_special_tokens=False).input_ids
    sample = Sample(prompt_tokens=prompt["prompt_tokens"], response_tokens=tokens, metadata={"label": prompt["label"]})
    assert task.reward(sample) == {"score": 1.0}


def ground_truth_reward(response_text, label, sample=None):
    """A reward reading a search-r1 style dict label."""
    return {"score": float(any(t in response_text for t in label["ground_truth"]["target"]))}


def test_bad_parquet_rows_are_refused_naming_file_and_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", None]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d\.parquet:row 1: missing key 'answer'"):
        load_rows(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": [1, 2], "answer": ["1", "2"]}), tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints\.parquet:row 0: 'prompt' must be a string"):
        load_rows(tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints\.parquet: no column 'question'"):
        load_rows(tmp_path / "ints.parquet", prompt_key="question")


def test_missing_and_empty_data_sets_are_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="empty.jsonl has no rows"):
        load_rows(write_lines(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(ValueError, match=r"must end in \.jsonl or \.parquet"):
        load_rows(write_lines(tmp_path / "d.csv", ["prompt,answer"]))


def test_a_reward_that_cannot_take_the_reward_args_fails_at_start_up(arith_path, text_model_dir):
    with pytest.raises(TypeError, match="pattern"):
        TextDataTask(path=arith_path, tokenizer=text_model_dir, reward="rollout_fns.verifiers:regex_reward")
    with pytest.raises(TypeError, match="unexpected keyword"):
        TextDataTask(path=arith_path, tokenizer=text_model_dir, reward_args={"no_such_option": 1})


# --- order, epochs, filtering, skipping --------------------------------------------------------------------------

def test_prompts_are_deterministic_per_seed_and_reshuffled_each_epoch(arith_path, text_model_dir):
    task = TextDataTask(path=arith_path, tokenizer=text_model_dir)
    first = [p["row"] for p in itertools.islice(task.prompts(seed=7), 50)]
    again = [p["row"] for p in itertools.islice(task.prompts(seed=7), 50)]
    other = [p["row"] for p in itertools.islice(task.prompts(seed=8), 50)]
    assert first == again and first != other
    epoch0, epoch1 = first[:20], first[20:40]
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))  # every row once per epoch
    assert epoch0 != epoch1
    assert [p["epoch"] for p in itertools.islice(task.prompts(seed=7), 41)][-2:] == [1, 2]


def test_without_shuffle_rows_come_in_file_order_every_epoch(arith_path, text_model_dir):
    task = TextDataTask(path=arith_path, tokenizer=text_model_dir, shuffle=False)
    assert [p["row"] for p in itertools.islice(task.prompts(seed=0), 25)] == list(range(20)) + list(range(5))


def test_max_prompt_tokens_drops_long_prompts_and_counts_each_row_once(tmp_path, text_model_dir, tokenizer):
    rows = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "What is 1+1? " * 30, "answer": "2"},
            {"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "What is 2+2? " * 40, "answer": "4"}]
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    short = len(chat_ids(tokenizer, [{"role": "user", "content": "What is 1+1?"}]))
    task = TextDataTask(path=path, tokenizer=text_model_dir, max_prompt_tokens=short + 5)
    drawn = [p["row"] for p in itertools.islice(task.prompts(seed=0), 6)]  # three epochs of the two short rows
    assert set(drawn) == {0, 2} and len(drawn) == 6
    assert task.filtered_prompts == 2


def test_a_data_set_with_every_prompt_too_long_is_an_error(arith_path, text_model_dir):
    task = TextDataTask(path=arith_path, tokenizer=text_model_dir, max_prompt_tokens=3)
    with pytest.raises(ValueError, match="all 20 rows are longer than max_prompt_tokens=3"):
        next(iter(task.prompts(seed=0)))


@pytest.mark.parametrize("max_prompt_tokens, filtered", [(None, 0), (16, 4)])  # 4 of the 20 prompts have 17 tokens
def test_skip_lands_where_next_would_and_tokenizes_nothing_without_a_limit(arith_path, text_model_dir,
                                                                          max_prompt_tokens, filtered, monkeypatch):
    walked = TextDataTask(path=arith_path, tokenizer=text_model_dir, max_prompt_tokens=max_prompt_tokens)
    expected = list(itertools.islice(walked.prompts(seed=3), 47))[-1]
    task = TextDataTask(path=arith_path, tokenizer=text_model_dir, max_prompt_tokens=max_prompt_tokens)
    encoded = []
    original = task.encode
    monkeypatch.setattr(task, "encode", lambda prompt: encoded.append(prompt) or original(prompt))
    skipped = task.prompts(seed=3)
    skipped.skip(46)
    assert len(encoded) == (0 if max_prompt_tokens is None else 20)  # with a limit, each row's length once
    assert task.filtered_prompts == walked.filtered_prompts == filtered
    assert next(skipped) == expected


def test_a_resumed_rollout_manager_draws_the_same_prompts(arith_path, text_model_dir):
    """The rollout manager's resume re-reads prompts(seed) and re-issues drawn-but-untrained groups."""
    from glue.rollout.manager import RolloutManager

    def manager():
        return RolloutManager(function_path="rollout_fns.single_turn:generate_group",
                              task_path="rollout_fns.text_data:TextDataTask", client=None, sampling_params={},
                              prompts_per_step=1, samples_per_prompt=1, seed=5,
                              task_args={"path": arith_path, "tokenizer": text_model_dir})
    original = manager()
    drawn = [next(original._prompts) for _ in range(4)]
    resumed = manager()
    resumed.resume(groups_drawn=3, reissue=[1])
    assert resumed._reissue == [(1, drawn[1])]
    assert next(resumed._prompts) == drawn[3]


# --- rewards ---------------------------------------------------------------------------------------------------

class ScriptedClient:
    """Answers /generate like SGLang (output_ids, logprobs, finish_reason, weight_version) with fixed text."""

    def __init__(self, tokenizer, text: str):
        self.tokens = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        return {"output_ids": self.tokens, "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in self.tokens],
            "finish_reason": {"type": "stop"}, "weight_version": "0"}}


@pytest.mark.parametrize("answer_text, score", [("12+7 = 19, so \\boxed{19}", 1.0), ("\\boxed{18}", 0.0),
                                                ("}{garbage", 0.0)])
def test_a_rollout_step_decodes_responses_and_scores_them_against_the_label(tmp_path, text_model_dir, tokenizer,
                                                                            answer_text, score):
    from glue.rollout.manager import RolloutManager

    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "What is 12+7?", "answer": "19"})])
    manager = RolloutManager(function_path="rollout_fns.single_turn:generate_group",
                             task_path="rollout_fns.text_data:TextDataTask",
                             client=ScriptedClient(tokenizer, answer_text), sampling_params={},
                             prompts_per_step=1, samples_per_prompt=2, seed=0,
                             task_args={"path": path, "tokenizer": text_model_dir})
    [group] = asyncio.run(manager.generate_step())
    assert group.error is None
    assert group.rewards == [score, score]
    assert group.samples[0].metadata["label"] == "19"
    assert group.samples[0].reward["format_ok"] == 1.0 * ("boxed" in answer_text)


def test_reward_skips_special_tokens_and_passes_reward_args(arith_path, text_model_dir, tokenizer):
    task = TextDataTask(path=arith_path, tokenizer=text_model_dir, reward="rollout_fns.verifiers:regex_reward",
                        reward_args={"pattern": r"Answer:\s*(\S+)$"})
    tokens = tokenizer("Answer: 19", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    sample = Sample(prompt_tokens=[1], response_tokens=tokens, metadata={"label": "19"})
    assert task.reward(sample)["correct"] == 1.0  # "$" matches only because <|im_end|> was not decoded
    with pytest.raises(ValueError, match="no 'label' in metadata"):
        task.reward(Sample(prompt_tokens=[1], response_tokens=tokens))


def test_a_tokenizer_without_a_chat_template_needs_apply_chat_template_off(tmp_path, arith_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="has no chat_template"):
        TextDataTask(path=arith_path, tokenizer=str(tmp_path / "plain"))
    task = TextDataTask(path=arith_path, tokenizer=str(tmp_path / "plain"), apply_chat_template=False)
    assert next(iter(task.prompts(seed=0)))["prompt_tokens"]


def test_tiny_text_model_refuses_a_vocabulary_smaller_than_the_bytes(tmp_path):
    from glue.embedded_engine.tiny_text_model import save_tiny_text_model

    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        save_tiny_text_model(tmp_path / "m", vocab_size=128)


def test_arith_rows_are_seeded_and_their_answers_are_right():
    rows = arith_rows(50, seed=9, low=-5, high=30, operators="+-*")
    assert rows == arith_rows(50, seed=9, low=-5, high=30, operators="+-*") != arith_rows(50, seed=10)
    for row in rows:
        a, op, b = re.fullmatch(r"What is (-?\d+)([-+*])(-?\d+)\?", row["prompt"]).groups()
        assert int(row["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    with pytest.raises(ValueError, match="operators"):
        arith_rows(1, seed=0, operators="/")
