"""sluice's glue, in wings that each name one concept (docs/architecture.md draws them):

- `loop/`: the driver, sync and async: controller, stream, buffer, staleness gate, batch, checkpoints, colocation,
  evaluation, replay, and the `sync:` / `eval:` settings;
- `rollout/`: the rollout manager, what it records (routed experts, OpenAI-agent calls), the `rollout:` settings;
- `rewards/`: reward models, the LLM judge, the scalar RM, the teacher, reward shaping, the killable reward pool, and
  the `reward:` / `judge:` / `reward_model:` / `teacher:` settings;
- `trainer/`: the megatron-core actor; `fleet/`: engines behind sgl-router (start, watch, talk to them);
  `embedded_engine/`: the CPU SGLang double and the tiny text model; `metrics/`: logger, plots, learning curves;
- `sft/`: supervised fine-tuning on the same trainer; `types.py` (Sample, groups, train batches) and `plugins.py`
  (loading user code by import path) at the root.

Wings depend one way, `sft -> loop -> {rollout, rewards, trainer} -> {fleet, embedded_engine, metrics} -> {types,
plugins}` (tests/test_architecture.py reads every import and fails on an arrow the other way). Backends (ray,
megatron, sglang) are imported lazily by the modules that need them.
"""
