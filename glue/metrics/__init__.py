"""Metrics: what a run records and draws.

Owns the per-step logger and timers (`logger.py`: metrics.jsonl, TensorBoard, W&B), plots of a run and of runs
compared (`plots.py`), and the learning-curve tables (`learning_curves.py`).
May import: types, plugins. Never another wing.
"""
