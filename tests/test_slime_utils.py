"""The `slime.utils` helpers slime's functions import (async_utils.run, mask_utils, misc.SingletonMeta,
processing_utils.load_tokenizer, http_utils.get_rollout_num_engines), used as slime's code uses them, and the `args`
namespace: every slime argument with slime's default, and slime's flags (--rm-type, --rollout-stop,
--eval-max-context-len) reaching it and the sampling params."""
from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from glue.rollout.slime import shim
from glue.rollout.slime.adapter import slime_args
from launch.config import load_config

shim.install()  # what sluice does before loading a slime function; slime itself is not installed here

from slime.utils.async_utils import run  # noqa: E402
from slime.utils.http_utils import get_rollout_num_engines  # noqa: E402
from slime.utils.mask_utils import MultiTurnLossMaskGenerator, get_response_lengths  # noqa: E402
from slime.utils.misc import SingletonMeta  # noqa: E402
from slime.utils.processing_utils import load_tokenizer  # noqa: E402

CALLER = contextvars.ContextVar("caller", default="unset")


async def double_later(x):
    await asyncio.sleep(0.01)
    return 2 * x, CALLER.get(), threading.current_thread().name


async def fails(args=None, sample=None, sampling_params=None):
    raise KeyError("boom")


def test_async_utils_run_blocks_until_the_coroutine_is_done_on_one_background_loop_with_the_caller_s_context():
    CALLER.set("rollout thread")
    value, seen, thread = run(double_later(21))
    assert (value, seen) == (42, "rollout thread") and thread != threading.current_thread().name
    results = []
    workers = [threading.Thread(target=lambda i=i: results.append(run(double_later(i))[0])) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sorted(results) == [0, 2, 4, 6]
    assert run(double_later(1))[2] == thread  # the same loop thread every time, as slime's one global loop
    with pytest.raises(KeyError, match="boom"):
        run(fails())


def test_async_utils_run_from_a_coroutine_on_its_own_loop_is_refused_instead_of_hanging():
    async def nested():
        return run(double_later(1))

    with pytest.raises(RuntimeError, match="called from a coroutine on its own loop"):
        run(nested())


def test_the_run_s_end_stops_async_utils_run_s_loop_and_a_later_run_starts_another():
    from glue.rollout.slime.utils import stop_async_loop

    async def tag(value):
        return threading.current_thread().name, value

    assert run(tag(1)) == ("slime-async-loop", 1)
    assert "slime-async-loop" in [t.name for t in threading.enumerate()]
    assert stop_async_loop() is True
    assert "slime-async-loop" not in [t.name for t in threading.enumerate()]
    assert run(tag(2)) == ("slime-async-loop", 2)  # a later run in the same process gets a fresh loop
    assert stop_async_loop() is True


def test_singleton_meta_gives_one_instance_until_cleared():
    class State(metaclass=SingletonMeta):
        def __init__(self, n):
            self.n = n

    assert State(1) is State(2) and State(3).n == 1
    State.clear_instances()
    assert State(4).n == 4


def test_get_rollout_num_engines_reads_the_rollout_gpus_per_engine():
    args = slime_args(router_url="http://127.0.0.1:1", model_path="/m", sampling_params={"max_new_tokens": 4},
                      samples_per_prompt=2, prompts_per_step=1, seed=0, generate_path=None, reward_path=None,
                      run_values={"rollout_num_gpus": 8, "rollout_num_gpus_per_engine": 2})
    assert get_rollout_num_engines(args) == 4
    args.rollout_num_gpus = None
    assert get_rollout_num_engines(args) == 0


# Qwen2.5-style ChatML: a default system turn when the chat has none, consecutive tool answers in one user turn
QWEN_LIKE_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>' + m['content'] + '</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

CHAT = [{"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "<tool>add 2 3</tool>"},
        {"role": "tool", "content": "5"}, {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "try again", "step_loss_mask": 0},
        {"role": "assistant", "content": "It is 5"}]


@pytest.fixture
def qwen_like(tokenizer):
    tok = load_tokenizer(tokenizer.name_or_path, local_files_only=True)
    tok.chat_template = QWEN_LIKE_TEMPLATE
    return tok


@pytest.mark.parametrize("tokenizer_type", ["qwen", "qwen3", "qwen3_5"])
def test_the_loss_mask_covers_only_the_assistant_s_own_trained_tokens(qwen_like, tokenizer_type):
    generator = MultiTurnLossMaskGenerator(qwen_like, tokenizer_type=tokenizer_type)
    ids, mask = generator.get_loss_mask(CHAT)
    whole = qwen_like(qwen_like.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids == whole and len(mask) == len(ids)
    assert generator.get_text_from_loss_mask(ids, mask) == ["<tool>add 2 3</tool><|im_end|>\n", "It is 5<|im_end|>\n"]


def test_the_generator_measures_the_template_s_default_system_turn_and_the_assistant_header(qwen_like):
    generator = MultiTurnLossMaskGenerator(qwen_like, tokenizer_type="qwen")
    system = qwen_like("<|im_start|>system\nYou are helpful.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    header = qwen_like("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert (generator.system_message_length, generator.gen_token_length) == (len(system), len(header))
    assert generator.find_all_sublist_indices([1, 2, 1, 2, 3], [1, 2]) == [0, 2]


def test_distill_qwen_trains_the_last_message_after_the_first_one_s_prompt(qwen_like):
    generator = MultiTurnLossMaskGenerator(qwen_like, tokenizer_type="distill_qwen")
    ids, mask = generator.get_loss_mask([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    prompt = qwen_like.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert qwen_like.decode(ids) == prompt + "yo" and generator.get_text_from_loss_mask(ids, mask) == ["yo"]
    _, padded = generator.get_loss_mask_with_multimodal_alignment(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "yo"}],
        input_ids=[0, 0] + ids)
    assert padded == [0, 0] + mask
    with pytest.raises(ValueError, match="Unsupported tokenizer type: llama"):
        MultiTurnLossMaskGenerator(qwen_like, tokenizer_type="llama").get_loss_mask(CHAT)


def test_response_lengths_run_from_the_first_trained_token_to_the_end():
    assert get_response_lengths([[0, 0, 1, 0, 1], [0, 0], [1]]) == [3, 0, 1]


def test_the_functions_args_carry_every_slime_argument_with_slime_s_default_and_the_run_s_values():
    from launch.slime.args import ROWS
    from launch.slime.megatron import SCHEDULE, SHAPE_ARGS

    args = vars(slime_args(router_url="http://127.0.0.1:1", model_path="/m", sampling_params={"max_new_tokens": 4},
                           samples_per_prompt=2, prompts_per_step=3, seed=5, generate_path=None, reward_path=None,
                           max_context_len=100))
    # slime's own defaults (slime/utils/arguments.py), for arguments no sluice setting decides
    assert (args["eps_clip"], args["eps_clip_high"], args["n_samples_per_eval_prompt"], args["input_key"],
            args["loss_mask_type"], args["sglang_server_concurrency"], args["update_weight_buffer_size"],
            args["lr"], args["seed"], args["use_critic"]) == (0.2, 0.2, 1, "input", "qwen", 512, 512 * 1024**2,
                                                              1e-6, 1234, False)
    # the run's values, and what slime derives from them
    assert (args["rollout_batch_size"], args["n_samples_per_prompt"], args["rollout_seed"],
            args["over_sampling_batch_size"], args["rollout_max_prompt_len"], args["eval_max_context_len"]) == \
        (3, 2, 5, 3, 99, 100)
    megatron_only = {row.name for row in (*SCHEDULE, *SHAPE_ARGS)}
    flags = {row.flag: row.name for row in ROWS if row.name not in megatron_only}
    disabled = {f"--disable-{name.replace('_', '-')}": name for name in args}  # --disable-x sets x
    assert [f for f, name in flags.items() if name not in args and disabled.get(f) not in args] == []


def test_rm_type_rollout_stop_and_eval_context_flags_reach_the_functions_args_and_the_sampling_params():
    from launch.args.command_line import parse_args
    from launch.config import SluiceConfig, build, compose
    from launch.run.components import make_slime_functions

    assert load_config("examples/configs/demo.yaml", []).rollout.sampling.to_sglang().get("stop") is None
    flags, overrides = parse_args(["--config", "examples/configs/demo.yaml", "--rm-type", "dapo", "--rollout-stop",
                                   "</search>", "</answer>", "--rollout-stop-token-ids", "7",
                                   "--rollout-max-context-len", "64", "--eval-max-context-len", "96",
                                   "rollout.slime.generate_function=test_slime_utils:fails"])
    cfg = build(SluiceConfig, compose(flags.config, overrides, flags.flags, flags.slime), prefix="")
    assert cfg.rollout.sampling.to_sglang()["stop"] == ["</search>", "</answer>"]
    args = make_slime_functions(cfg, None, "/nonexistent").args
    assert (args.rm_type, args.rollout_stop, args.rollout_stop_token_ids, args.rollout_max_context_len,
            args.eval_max_context_len, args.rollout_max_prompt_len) == \
        ("dapo", ["</search>", "</answer>"], [7], 64, 96, 63)
    assert (args.num_rollout, args.rollout_num_gpus) == (cfg.run.num_steps, cfg.rollout.num_engines)
