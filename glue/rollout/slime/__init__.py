"""slime's rollout and reward functions run unchanged: `adapter.py` (calling them with slime's arguments, their
samples back into sluice's with a weight version per token), `sample.py` (slime's `Sample`, the rollout outputs and
the conversions at the seam), `sglang_rollout.py` (slime's GenerateState, generate, generate_and_rm,
generate_and_rm_group, generate_rollout), `rollout_calls.py` and `data_source.py` (slime's long-lived whole-rollout
contract: one call per step's groups, one data source for the run), `http_calls.py` (`post` / `get` to the fleet),
`user_code.py` (loading a function by path, its module's exit hooks), `rm_hub/` (slime's rule-based rewards),
`utils.py` and `mask_utils.py` (the rest of `slime.utils` functions import), `defaults.py` (every slime argument's
default, the base of the functions' `args`) and `shim.py` (the `slime` modules they import, for where slime is not
installed). The rollout function that a run names is rollout_fns.slime_functions; slime's
launch arguments are launch.slime.
May import: the rest of glue.rollout and what it may import (fleet, embedded_engine, metrics, types, plugins)."""
