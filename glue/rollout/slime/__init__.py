"""slime's rollout and reward functions run unchanged: `adapter.py` (loading them by path, calling them with slime's
arguments, their samples back into sluice's with a weight version per token), `sample.py` (slime's `Sample` and the
conversions at the seam) and `shim.py` (the `slime` modules they import, for where slime is not installed). The
rollout function that a run names is rollout_fns.slime_functions; slime's launch arguments are launch.slime.
May import: the rest of glue.rollout and what it may import (fleet, embedded_engine, metrics, types, plugins)."""
