"""The repository stands on its own: nothing a user reads or runs (README, docs, code, configs, scripts) points at a
file outside the clone, and the README's architecture link resolves to a page in it."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the sibling folder the project was started from, which no one who clones sluice has
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w/.-])shared/(DESIGN|STYLE|PLATFORM|FINDINGS|seeds)")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith((".md", ".py", ".yaml", ".sh", ".txt", ".ini")) or n == "Makefile"]


def test_nothing_in_the_repository_points_outside_it():
    this = Path(__file__).resolve()
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:120]}"
            for p in tracked_text_files() if p.resolve() != this and p.exists()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if OUTSIDE.search(line)]
    assert hits == []


def test_the_pattern_catches_a_pointer_outside():
    assert OUTSIDE.search("The architecture is in `../shared/DESIGN.md`")
    assert OUTSIDE.search("see shared/seeds/README.md")
    assert not OUTSIDE.search("see [the algorithms](algorithms.md#reading) and docs/architecture.md")


def test_the_readme_links_the_architecture_page_and_it_names_every_wing():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/architecture.md)" in readme
    page = (ROOT / "docs" / "architecture.md").read_text()
    wings = sorted(p.parent.name for p in (ROOT / "glue").glob("*/__init__.py"))
    assert wings and [w for w in wings if f"glue/{w}/" not in page] == []
