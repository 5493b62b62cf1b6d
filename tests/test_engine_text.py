"""The embedded and strict engines speak text as SGLang 0.5.23 does when their model has a tokenizer: `text` prompts
(one or a batch), `stop` strings matched on the decoded output and trimmed from the answer's `text` (kept with
no_stop_trim), stop tokens left out of the text, and SGLang's refusals when the model has no tokenizer."""
from __future__ import annotations

import pytest

from glue.embedded_engine.request_schema import RequestError, parse_generate
from helpers.engines import call, generate

GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
PROMPT = "What is 12+7?"


@pytest.fixture(scope="module", params=["embedded", "strict"])
def text_engine(request, engine_processes, text_model_dir) -> str:
    extra = ("--sglang-strict",) if request.param == "strict" else ()
    return engine_processes.start(text_model_dir, "--seed", "0", *extra)


def first_stop_string(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A two-letter stop string that starts inside one of `ids`' tokens and appears nowhere before it, and how many
    tokens SGLang keeps when it matches (through the token that completes it)."""
    for k in range(1, len(ids)):
        piece = tokenizer.decode([ids[k]])
        if len(piece) >= 3 and piece[:2].isalpha() and piece[:2] not in tokenizer.decode(ids[:k]):
            stop = piece[:2]
            return stop, next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
    raise AssertionError(f"no token of {ids} starts with two letters")


def test_a_text_prompt_is_tokenized_and_the_answer_carries_its_decoded_text(text_engine, tokenizer):
    by_text = generate(text_engine, {"text": PROMPT, "sampling_params": GREEDY})
    by_ids = generate(text_engine, {"input_ids": tokenizer(PROMPT).input_ids, "sampling_params": GREEDY})
    assert list(by_text) == ["text", "output_ids", "meta_info"]
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["text"] == by_ids["text"]
    assert by_text["meta_info"]["prompt_tokens"] == len(tokenizer(PROMPT).input_ids)
    assert by_text["text"] == tokenizer.decode(by_text["output_ids"], skip_special_tokens=True)
    assert by_text["meta_info"]["finish_reason"] == {"type": "length", "length": 16}


def test_a_batch_of_texts_answers_one_result_per_text_in_order(text_engine):
    texts = [PROMPT, "Say hi.", PROMPT]
    outputs = generate(text_engine, {"text": texts, "sampling_params": {**GREEDY, "max_new_tokens": 4}})
    assert len(outputs) == 3 and outputs[0]["text"] == outputs[2]["text"]
    assert outputs[0]["output_ids"] == outputs[2]["output_ids"]


def test_a_stop_string_ends_generation_and_is_trimmed_from_the_text_unless_no_stop_trim(text_engine, tokenizer):
    free = generate(text_engine, {"text": PROMPT, "sampling_params": GREEDY})["output_ids"]
    stop, kept = first_stop_string(tokenizer, free)
    decoded = tokenizer.decode(free[:kept], skip_special_tokens=True)
    for no_stop_trim, text in [(False, decoded[:decoded.find(stop)]),
                               (True, decoded[:decoded.find(stop) + len(stop)])]:
        params = {**GREEDY, "stop": ["never-in-this-output", stop], "no_stop_trim": no_stop_trim}
        out = generate(text_engine, {"text": PROMPT, "sampling_params": params})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["output_ids"] == free[:kept]  # the tokens that made the stop string stay in output_ids
        assert out["text"] == text


def test_a_stop_token_is_left_out_of_the_text_and_ignore_eos_turns_stop_tokens_off(text_engine, tokenizer):
    free = generate(text_engine, {"text": PROMPT, "sampling_params": GREEDY})["output_ids"]
    token = free[3]
    kept = free[:free.index(token) + 1]
    params = {**GREEDY, "ignore_eos": False, "stop_token_ids": [token]}
    out = generate(text_engine, {"text": PROMPT, "sampling_params": params})
    if out["meta_info"]["finish_reason"]["matched"] != token:  # the model's eos came first
        pytest.skip(f"eos before stop token {token} in {out['output_ids']}")
    assert out["output_ids"] == kept
    assert out["text"] == tokenizer.decode(kept[:-1], skip_special_tokens=True)
    kept_text = generate(text_engine, {"text": PROMPT, "sampling_params": {**params, "no_stop_trim": True}})["text"]
    assert kept_text == tokenizer.decode(kept, skip_special_tokens=True)
    ignoring = generate(text_engine, {"text": PROMPT, "sampling_params": {**GREEDY, "stop_token_ids": [token]}})
    assert ignoring["meta_info"]["finish_reason"] == {"type": "length", "length": 16}  # SGLang: ignore_eos wins


def test_stop_strings_that_are_not_strings_are_refused_naming_the_field(text_engine):
    for stop, message in [(5, "must be a string or a list of strings"),
                          (["x"] * 33, "at most 32 stop strings are allowed, got 33")]:
        status, answer = call(text_engine, "/generate", {"text": PROMPT, "sampling_params": {"stop": stop}})
        assert status == 400 and message in str(answer), answer


def test_without_a_tokenizer_text_and_stop_strings_are_refused_as_sglang_refuses_them():
    body = {"text": "hi", "sampling_params": {}}
    with pytest.raises(RequestError, match="^text: this engine's model directory has no tokenizer; send input_ids"):
        parse_generate(body, vocab_size=32, max_context=64, next_rid=lambda: "r")
    body = {"input_ids": [1, 2], "sampling_params": {"stop": "</tool>"}}
    with pytest.raises(RequestError, match=r"^sampling_params.stop: stop=\['</tool>'\] needs a tokenizer"):
        parse_generate(body, vocab_size=32, max_context=64, next_rid=lambda: "r")
    with pytest.raises(RequestError, match="either text or input_ids must be provided"):
        parse_generate({"sampling_params": {}}, vocab_size=32, max_context=64, next_rid=lambda: "r")


def test_an_engine_without_a_tokenizer_answers_no_text_and_says_it_skips_tokenizer_init(engine_processes,
                                                                                         tiny_model_dir):
    url = engine_processes.start(tiny_model_dir, "--sglang-strict")
    out = generate(url, {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
    assert "text" not in out
    assert call(url, "/get_server_info")[1]["skip_tokenizer_init"] is True
    status, answer = call(url, "/generate", {"text": "hi"})
    assert status == 400 and "no tokenizer" in str(answer)
