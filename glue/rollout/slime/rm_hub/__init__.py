"""slime.rollout.rm_hub, written by sluice: the rule-based rewards `--rm-type` names and the two functions slime's
rollout and reward code awaits, `async_rm(args, sample)` and `batched_async_rm(args, samples)`.

`async_rm` follows slime's order: the sample's own `custom_rm_path`, then `args.custom_rm_path`, then the rule named
by `sample.metadata["rm_type"]` or `args.rm_type` over `sample.response` and `sample.label`; a `boxed_` prefix
(`boxed_f1`) first reduces the response to its last `\\boxed{}` answer. Rules and their rewards: deepscaler and math
0 / 1, dapo {"score": 1.0 / -1.0, "acc", "pred"}, f1 the token F1, gpqa and ifbench 0.0 / 1.0, random 0 / 1 at
random, remote_rm whatever `args.rm_url` answers a POST of {"prompt", "response", "label"} with.
Labels: deepscaler, math, dapo and f1 compare text and take a string or a number (anything else is refused in one
line naming its type); gpqa takes a letter, an option's index or its text; remote_rm sends any JSON label as it is.

`MODULES` is what the stand-in `slime` package (glue.rollout.slime.shim) registers under slime's names.
"""
from __future__ import annotations

import asyncio
import importlib
import random
from typing import Any

from glue.rollout.slime.rm_hub import deepscaler, f1, gpqa, ifbench, math_dapo_utils, math_utils
from glue.rollout.slime.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from glue.rollout.slime.rm_hub.f1 import f1_score
from glue.rollout.slime.rm_hub.gpqa import compute_gpqa_reward
from glue.rollout.slime.rm_hub.ifbench import compute_ifbench_reward
from glue.rollout.slime.rm_hub.math_dapo_utils import compute_score as compute_score_dapo
from glue.rollout.slime.rm_hub.math_utils import extract_answer as extract_boxed_answer, grade_answer_verl

RULES = ("deepscaler", "dapo", "math", "f1", "gpqa", "ifbench", "random", "remote_rm")
REMOTE_RETRIES = 10
REMOTE_TIMEOUT_S = 120.0


def _load(path: str) -> Any:
    """slime's load_function: 'package.module.function'."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def rule_reward(rm_type: str, response: str, label: Any, metadata: dict) -> Any:
    """The reward of the rule-based `rm_type` (not remote_rm) for one response."""
    if rm_type.startswith("boxed_"):
        response, rm_type = extract_boxed_answer(response) or "", rm_type[len("boxed_"):]
    if rm_type == "deepscaler":
        return get_deepscaler_rule_based_reward(response, label)
    if rm_type == "dapo":
        return compute_score_dapo(response, label)
    if rm_type == "math":
        return int(grade_answer_verl(response, label))
    if rm_type == "f1":
        return f1_score(response, label)[0]
    if rm_type == "gpqa":
        return compute_gpqa_reward(response, label, metadata=metadata)
    if rm_type == "ifbench":
        return compute_ifbench_reward(response, label, metadata=metadata)
    if rm_type == "random":
        return random.randint(0, 1)
    if not rm_type:
        raise NotImplementedError("no rule-based reward is named: set --rm-type (args.rm_type), "
                                  "sample.metadata['rm_type'] or --custom-rm-path")
    raise NotImplementedError(f"rm_type {rm_type!r} is not a rule-based reward of slime's rm_hub; choose one of "
                              f"{', '.join(RULES)} (or boxed_<one of them>)")


async def remote_rm(args: Any, sample: Any, max_retries: int = REMOTE_RETRIES) -> Any:
    """POST {"prompt", "response", "label"} to `args.rm_url`, its JSON answer back; a failed try is repeated after
    min(2**attempt, 30) s plus up to 1 s of jitter, and the last failure raised."""
    import aiohttp

    if not getattr(args, "rm_url", None):
        raise ValueError("rm_type remote_rm needs args.rm_url (--rm-url), the reward service's URL")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    timeout = aiohttp.ClientTimeout(total=REMOTE_TIMEOUT_S)
    for attempt in range(max_retries):
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.post(args.rm_url, json=payload) as resp:
                    resp.raise_for_status()
                    return await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            if attempt + 1 >= max_retries:
                raise
            await asyncio.sleep(min(2 ** attempt, 30) + random.random())


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    """The reward of one sample, as slime's rm_hub gives it (see the module docstring for the order)."""
    own = getattr(sample, "custom_rm_path", None)
    if own:
        return await _load(own)(args, sample, **kwargs)
    if args.custom_rm_path is not None:
        return await _load(args.custom_rm_path)(args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or args.rm_type or "").strip()
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    return rule_reward(rm_type, sample.response, sample.label, metadata)


async def batched_async_rm(args: Any, samples: list[Any], **kwargs: Any) -> list[Any]:
    """The rewards of `samples`, in order: `args.custom_rm_path` called once on the whole list when set (it must
    take a list), else `async_rm` on each, concurrently."""
    if args.custom_rm_path is not None:
        return await _load(args.custom_rm_path)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))


def _public(module: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "annotations"}


MODULES = {
    "slime.rollout.rm_hub": {name: globals()[name] for name in (
        "async_rm", "batched_async_rm", "remote_rm", "get_deepscaler_rule_based_reward", "f1_score",
        "compute_gpqa_reward", "compute_score_dapo", "extract_boxed_answer", "grade_answer_verl")},
    **{f"slime.rollout.rm_hub.{m.__name__.rsplit('.', 1)[1]}": _public(m)
       for m in (deepscaler, f1, gpqa, ifbench, math_dapo_utils, math_utils)},
}
