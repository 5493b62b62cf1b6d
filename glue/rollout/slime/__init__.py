"""slime's rollout and reward functions run unchanged: `adapter.py` (loading them by path, calling them with slime's
arguments, their samples back into sluice's with a weight version per token), `sample.py` (slime's `Sample` and the
conversions at the seam), `shim.py` (the `slime` modules they import, for where slime is not installed), with
`rm_hub/` (slime's rule-based rewards), `utils.py` and `mask_utils.py` (the rest of `slime.utils` functions import)
and `defaults.py` (every slime argument's default, the base of the functions' `args`). The
rollout function that a run names is rollout_fns.slime_functions; slime's launch arguments are launch.slime.
May import: the rest of glue.rollout and what it may import (fleet, embedded_engine, metrics, types, plugins)."""
