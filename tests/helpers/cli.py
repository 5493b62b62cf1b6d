"""The CLI's one-line config errors, as `--dry-run` prints them."""
from __future__ import annotations

from launch.cli import main

DEMO = "examples/configs/demo.yaml"


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(["--dry-run", "--config", DEMO, *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice: config error: "), captured.err
    assert captured.out == ""
    return lines[0]


def run_error(capsys, argv: list[str]) -> tuple[str, float]:
    """A run that fails at start-up: its one `sluice: error:` line (stderr holds no other, and no traceback) and the
    seconds it took."""
    import time

    started = time.monotonic()
    code = main(["--config", DEMO, *argv])
    took = time.monotonic() - started
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("sluice:")]
    assert code == 1 and len(errors) == 1 and errors[0].startswith("sluice: error: "), err
    assert "Traceback" not in err, err
    return errors[0], took
