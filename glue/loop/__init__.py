"""The loop: the driver that turns finished groups into train steps and decides when weights move.

Owns the controller (one step: collect -> train -> sync -> log/save), the rollout stream and its buffer, the
staleness gate, batch building (advantages, distillation's term), colocation's phase switches, checkpoints,
evaluation, replay of a logged step, and the `sync:` / `eval:` settings (`config.py`).
May import: rollout, rewards, trainer, fleet, embedded_engine, metrics, types, plugins; loss and weight_sync.
Never imported by them (only sft and launch stand above it).
"""
