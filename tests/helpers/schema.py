"""SGLang's source read with `ast`: class fields and string constants (sglang is not importable on CPU)."""
from __future__ import annotations

import ast
from pathlib import Path


def class_fields(path: Path) -> dict[str, set[str]]:
    """Annotated field names of every class in a module, inherited ones from classes of the same module included."""
    tree = ast.parse(path.read_text())
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own[node.name] = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def collect(name: str) -> set[str]:
        return own.get(name, set()).union(*(collect(b) for b in bases.get(name, []) if b in own))

    return {name: collect(name) for name in own}


def string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
