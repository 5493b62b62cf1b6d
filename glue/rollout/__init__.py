"""Rollout: running the user's rollout function for each prompt and recording what the engines did.

Owns the rollout manager (`manager.py`: tasks, groups, scoring, the helpers a rollout function calls), MoE routing
records from the engine (`routed_experts.py`), the OpenAI-client agent recorder (`openai_agent.py`), the adapter that
runs slime's rollout and reward functions (`slime/`: the adapter, slime's `Sample` and the `slime` modules they
import) and the `rollout:` / sampling settings (`config.py`).
May import: fleet, embedded_engine, metrics, types, plugins. Never loop, rewards or trainer.

The rollout-function API (`RolloutContext`, `append_generation`, `score`, `resume_limit`) also loads from here, on
first use, so `from glue.rollout import RolloutContext` stays light for code that never touches it.
"""
from typing import Any

_MANAGER_API = ("RolloutContext", "RolloutManager", "append_generation", "score", "resume_limit")


def __getattr__(name: str) -> Any:
    if name in _MANAGER_API:
        from glue.rollout import manager  # lazy: glue.rollout.config (read by launch.config) must not load the manager

        return getattr(manager, name)
    raise AttributeError(f"module 'glue.rollout' has no attribute {name!r}")
