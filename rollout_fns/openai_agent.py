"""The rollout function for agents written with the `openai` package: each of `num_samples` runs of the prompt's
agent gets an `openai.AsyncOpenAI` on the fleet (router url + /v1); its recorded chat completions become one sample
per policy-visible trajectory (`glue.rollout.openai_agent.trajectory_samples`), every one scored with the run's reward.

The agent is named by import path in the prompt, `prompt["agent"] = "pkg.module:agent"`, with the signature

    async def agent(client: openai.AsyncOpenAI, prompt: dict) -> float | dict   # the reward of this run

(checked when first loaded). A run whose calls all extend one conversation gives one sample; a run that starts over
or branches gives more, so a group may hold more than `num_samples` samples. Agents' calls carry no MoE routing, so
this function refuses `rollout.return_routed_experts` (at start-up, launch/run/preflight.py, and here). Agents never
see a sync's abort: the recorder continues an aborted completion (up to `ctx.max_resumes` times); a run with one
still aborted then is given up, its samples ABORTED (rollout/resume_limit_drops), whatever the agent returned.
"""
from __future__ import annotations

import asyncio
import functools
import math
from typing import Any, Callable

from glue.rollout.openai_agent import ChatRecorder, trajectory_samples
from glue.plugins import check_signature, load_object
from glue.rollout.manager import RolloutContext
from glue.types import Sample, SampleStatus

AGENT_PARAMS = ["client", "prompt"]
NO_ROUTING = ("rollout.return_routed_experts: rollout_fns.openai_agent cannot record MoE routing (agents call "
              "/v1/chat/completions through sgl-router, which drops return_routed_experts); turn the key off or use "
              "rollout_fns.single_turn or rollout_fns.multi_turn")


async def generate_group(ctx: RolloutContext, prompt: dict, num_samples: int) -> list[Sample]:
    """Run the prompt's agent `num_samples` times concurrently; the samples of all runs, run by run."""
    if ctx.routed_experts is not None:
        raise ValueError(NO_ROUTING)
    agent = load_agent(prompt.get("agent"))
    base_url, api_key = chat_endpoint(ctx.client)
    tasks = [asyncio.ensure_future(run_agent(agent, prompt, base_url=base_url, api_key=api_key, run=i,
                                             engine_urls=getattr(ctx.client, "engine_urls", None),
                                             max_resumes=ctx.max_resumes))
             for i in range(num_samples)]
    try:
        runs = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one failed run fails the group: stop the others' calls too
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    samples = [sample for run in runs for sample in run]
    for index, sample in enumerate(samples):
        sample.group_id, sample.index = ctx.group_id, index
    return samples


async def run_agent(agent: Callable, prompt: dict, *, base_url: str, api_key: str | None, run: int,
                    engine_urls: list[str] | None = None, max_resumes: int = 8) -> list[Sample]:
    """One agent run, recorded: its trajectories as samples carrying its reward and the prompt's other keys.
    Aborted completions are continued on `engine_urls` (`ChatRecorder`); if one was given up at `max_resumes`,
    whatever the agent did after the error it got (raise, or go on) the run's samples are ABORTED, reward 0."""
    async with ChatRecorder(base_url, api_key=api_key, engine_urls=engine_urls, max_resumes=max_resumes) as recorder:
        try:
            reward = checked_reward(await agent(recorder.client, prompt))
        except Exception:  # noqa: BLE001 - after a give-up the agent's error is that refusal's: counted below
            if not recorder.gave_up:
                raise
        if recorder.gave_up:
            reward = 0.0
    recorder.check()
    samples = trajectory_samples(recorder.calls)
    if not samples:
        raise ValueError(f"agent {prompt['agent']!r} made no chat completion call, so there is nothing to train on")
    extras = {k: v for k, v in prompt.items() if k != "prompt_tokens"}
    for trajectory, sample in enumerate(samples):
        sample.reward = reward
        sample.metadata = {**extras, **sample.metadata, "agent_run": run, "trajectory": trajectory}
        if recorder.gave_up:  # the run never finished: none of its trajectories is a whole answer to train on
            sample.status = SampleStatus.ABORTED
            sample.metadata["resume_limit_hit"] = 1
    return samples


def load_agent(path: Any) -> Callable:
    """The agent at import path `path` (the prompt's "agent"), its signature checked."""
    if not isinstance(path, str):
        raise ValueError(f"openai_agent: each prompt needs an 'agent' import path like 'pkg.module:agent', got "
                         f"{str(path)[:200]}")
    return _load_checked_agent(path)


@functools.lru_cache(maxsize=None)
def _load_checked_agent(path: str) -> Callable:
    agent = load_object(path, what="agent")
    check_signature(agent, AGENT_PARAMS, what=f"agent {path!r}")
    return agent


def chat_endpoint(client: Any) -> tuple[str, str | None]:
    """The OpenAI base URL of the fleet behind `client` (an `EngineClient`), and its api key."""
    router_url = getattr(client, "router_url", None)
    if not isinstance(router_url, str):
        raise TypeError(f"openai_agent needs ctx.client to be a glue.fleet.engine_client.EngineClient (it reads the "
                        f"router url from it), got {type(client).__name__}")
    return f"{router_url.rstrip('/')}/v1", getattr(client, "api_key", None)


def checked_reward(reward: Any) -> float | dict:
    """The agent's return value as a reward: a finite number, or a dict with a finite "score"."""
    score = reward.get("score") if isinstance(reward, dict) else reward
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise TypeError(f"an agent must return its reward, a finite number or a dict with a finite 'score', "
                        f"got {str(reward)[:200]}")
    return reward if isinstance(reward, dict) else float(reward)
