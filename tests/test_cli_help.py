"""`sluice --help` answers at once: the help paths import no backend (no torch, ray, megatron, transformers; the
megatron flags come from a snapshot of megatron-core's config tables, checked here against the installed ones), and
`--config X --help` shows X's values beside the defaults."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO_ROOT

HEAVY = ("torch", "ray", "megatron", "transformers", "sglang", "numpy")
HELP_PATHS = f"""
import contextlib, io, json, resource, sys
from launch.cli import main
out = {{}}
for topic in ([], ["megatron"], ["sglang"], ["router"], ["--config", "examples/configs/demo.yaml"]):
    with contextlib.redirect_stdout(io.StringIO()) as text:
        code = main(["--help", *topic] if topic[:1] != ["--config"] else [*topic, "--help"])
    out[" ".join(topic) or "config"] = [code, len(text.getvalue())]
out["heavy"] = [m for m in {HEAVY!r} if m in sys.modules]
out["cpu_s"] = resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime
print(json.dumps(out))
"""


def test_every_help_path_imports_no_backend_and_costs_little_cpu():
    done = subprocess.run([sys.executable, "-c", HELP_PATHS], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True, timeout=120)
    out = json.loads(done.stdout)
    assert out.pop("heavy") == []
    # all five helps in one process: ~0.4 s of CPU here, against ~4.8 s for one before (torch through loss,
    # megatron-core for its flag tables); the bound leaves room for a slow CI machine
    assert out.pop("cpu_s") < 4.0
    assert all(code == 0 and size > 1000 for code, size in out.values()), out


def test_help_with_a_config_shows_its_values_beside_the_defaults(capsys):
    from launch.cli import main

    assert main(["--config", "examples/configs/demo.yaml", "run.num_steps=7", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  run.num_steps  (int, default: 30, in demo.yaml + the command line: 7)" in lines
    assert "  trainer.lr  (float, default: 0.001, in demo.yaml + the command line: 0.005)" in lines
    assert "  run.seed  (int, default: 0)" in lines  # a key demo.yaml leaves alone shows the default alone
    assert main(["--config", "no/such.yaml", "--help"]) == 2
    assert capsys.readouterr().err.strip() == "sluice: error: --config no/such.yaml: no such file (see sluice --help)"


def test_the_megatron_flag_snapshot_is_the_installed_megatron_cores_tables():
    from glue.trainer.megatron_fields import installed_megatron_version, live_megatron_fields, snapshot_fields

    assert installed_megatron_version() is not None, "megatron-core is a dependency of sluice"
    # a new megatron-core (make constraints) needs `python -m glue.trainer.megatron_fields` to refresh the snapshot
    assert snapshot_fields() == live_megatron_fields()
