"""sluice's launcher: a command line (`launch.cli`) -> one typed run config (`launch.config`) -> a checked plan
(`launch.plan`) -> a running loop (`launch.run`). Its wings, each a package whose `__init__` says what it owns and
what it may import, from the bottom: `slime` (slime's launch arguments), `args` (the command line and every
back-end's pass-through table), `plan`, `run`, `tools` (rehearse, shrink, export-hf, smollm2). `config.py` sits
between `slime` and `args`; `cli.py` stands on top of them all. Nothing in glue/, loss/, weight_sync/ or
rollout_fns/ imports launch."""
