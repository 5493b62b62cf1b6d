"""Bringing a run up and down: `runner.py` (the RL run: plan, folder, Ray, fleet, trainer, bridge, then the loop) and
`sft.py` (an SFT run), `preflight.py` (the checks made before anything starts, by every run and by --dry-run: they
import the user's code), `cluster.py` (Ray and the placement group), `components.py`, `fleets.py`,
`reward_models.py` and `teacher.py` (the run's parts on their bundles), `tasks.py` and `user_code.py` (the user's
tasks and modules), `folder.py` (the run folder: fresh or resumed, what it leaves behind), `startup.py` and
`stopping.py` (start-up progress, signals).
May import: launch.plan, launch.args, launch.config, launch.slime. Never tools."""
