"""slime's launch arguments, as slime's scripts write them, turned into sluice config keys: one row per argument
(`spec.py`: `SlimeArg` and its builders), slime's own arguments (`table.py`, `table_algo.py`), the Megatron-LM flags
slime's scripts pass that are not megatron-core fields (`megatron.py`), and the table with its parser and help
(`args.py`). The functions half of slime's compatibility lives in glue/rollout/slime/.
May import: nothing else of launch (launch.config reads this wing to build a run config)."""
