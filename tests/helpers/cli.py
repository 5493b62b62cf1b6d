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
