"""The plan: a loaded config resolved into what a run will start and checked before anything starts, from the config
and config.json alone (no Ray, no processes, no user code): `run_plan.py` (`resolve` -> `RunPlan`: pass-through values
checked, parallel sizes against devices, engine and router commands, placement), `fleets.py` (the engine fleets on
their bundles), `model_check.py` (what the run reads from `model.path`), `memory.py` and `memory_lines.py` (bytes per
trainer rank and the dry run's memory lines), `weight_groups.py` (what each sync moves, through which groups).
May import: launch.args, launch.config, launch.slime. Never run or tools."""
