"""Benchmark output: sections merged into bench-results/scale.json."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import REPO_ROOT

OUT = REPO_ROOT / "bench-results" / "scale.json"


def write_section(values: dict[str, Any], out: Path = OUT) -> None:
    """Merge `values` into scale.json (the other sections stay as an earlier run wrote them)."""
    out.parent.mkdir(exist_ok=True)
    current = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**current, **values}, indent=2) + "\n")
