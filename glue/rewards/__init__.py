"""Rewards beyond the task's own: models that score responses, and shaping of the task's rewards.

Owns the group hook for model rewards (`models.py`), the LLM judge (`judge.py`), the scalar reward model
(`scalar_rm.py`), the distillation teacher's scorer (`teacher.py`), DAPO's overlong shaping (`shaping.py`), the
killable worker pool for reward code that can hang (`isolated.py`), and their settings (`config.py`).
May import: fleet, embedded_engine, metrics, types, plugins; loss. Never loop, rollout or trainer.
"""
