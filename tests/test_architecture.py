"""The architecture as code: glue's wings and launch's wings each depend one way, nothing below launch imports it,
and no module of the project imports itself round a circle. Read from the source (every import statement, function-local ones included), so an arrow added anywhere
fails here before a reader meets it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("glue", "launch", "loss", "weight_sync", "rollout_fns")
# Wings and their floors: a wing may import wings on lower floors and itself, never a wing on its own floor or above.
FLOORS = {"sft": 4, "loop": 3, "rollout": 2, "rewards": 2, "trainer": 2, "fleet": 1, "embedded_engine": 1,
          "metrics": 1, "types": 0, "plugins": 0}
# launch's wings on floors the same way; its two top-level modules stand among them: config (built from slime's
# arguments, read by everything above) and cli (the entry point, above all)
LAUNCH_FLOORS = {"cli": 6, "tools": 5, "run": 4, "plan": 3, "args": 2, "config": 1, "slime": 0}
WINGS = {"glue": FLOORS, "launch": LAUNCH_FLOORS}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside `if TYPE_CHECKING:` blocks: imports for annotations only, never executed."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def project_imports(path: Path, *, runtime_only: bool = False) -> list[tuple[str, int]]:
    """(imported project module, line) for every import in `path`; `from pkg import name` counts pkg.name when
    that is a module of its own."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree) if runtime_only else set()
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (ROOT / sub.replace(".", "/")).with_suffix(".py").exists() or \
                    (ROOT / sub.replace(".", "/") / "__init__.py").exists()
                found.append((sub if is_module else node.module, node.lineno))
    return [(name, line) for name, line in found if name.split(".")[0] in PACKAGES]


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "scripts" not in p.parts)


def wing_of(module: str) -> tuple[str, str] | None:
    """(package, wing) of a glue or launch module, None for anything else."""
    parts = module.split(".")
    if parts[0] not in WINGS or len(parts) < 2:
        return None
    return (parts[0], parts[1]) if parts[1] in WINGS[parts[0]] else None


def wing_violations() -> list[str]:
    bad = []
    for path in source_files():
        here = wing_of(module_name(path))
        if here is None:
            continue
        for target, line in project_imports(path):
            there = wing_of(target)
            if there is None or there == here or there[0] != here[0]:
                continue
            floors = WINGS[here[0]]
            if floors[there[1]] >= floors[here[1]]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {here[1]} -> {there[1]} ({target})")
    return bad


def imports_of_launch_from_below() -> list[str]:
    """Imports of launch from glue, loss, weight_sync or rollout_fns: launch stands above them all."""
    return [f"{path.relative_to(ROOT)}:{line}: {target}" for path in source_files()
            if path.relative_to(ROOT).parts[0] != "launch"
            for target, line in project_imports(path) if target.split(".")[0] == "launch"]


def import_cycles() -> list[list[str]]:
    """Strongly connected groups of more than one module in the runtime import graph."""
    graph: dict[str, set[str]] = {}
    for path in source_files():
        graph[module_name(path)] = {t for t, _ in project_imports(path, runtime_only=True)}
    known = set(graph)
    graph = {m: {t for t in ts if t in known and t != m} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_glue_and_launch_wings_depend_one_way():
    assert wing_violations() == []


def test_nothing_below_launch_imports_it():
    assert imports_of_launch_from_below() == []


def test_no_module_imports_itself_round_a_circle():
    assert import_cycles() == []


def test_every_wing_says_what_it_owns_and_what_it_may_import():
    for package, floors in WINGS.items():
        for wing in floors:
            init = ROOT / package / wing / "__init__.py"
            if not init.exists():
                assert (ROOT / package / f"{wing}.py").exists(), f"{package}.{wing}"
                continue
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            assert "May import" in doc, f"{package}/{wing}/__init__.py must say what the wing may import"


def test_launch_is_its_wings_and_two_modules():
    """Every module of launch lives in a wing the floors above know, or is one of its top-level modules."""
    loose = sorted(p.name for p in (ROOT / "launch").glob("*.py")
                   if p.stem not in LAUNCH_FLOORS and p.name not in ("__init__.py", "__main__.py"))
    unknown = sorted(p.name for p in (ROOT / "launch").iterdir()
                     if p.is_dir() and (p / "__init__.py").exists() and p.name not in LAUNCH_FLOORS)
    assert (loose, unknown) == ([], []), "place each in a wing of LAUNCH_FLOORS (or add the wing with its floor)"


def test_the_checker_sees_an_upward_arrow_and_a_circle(tmp_path, monkeypatch):
    """The two checks above fail on a tree with an arrow the other way and a circle."""
    for rel, text in {"glue/fleet/__init__.py": "", "glue/fleet/a.py": "from glue.loop import b\n",
                      "glue/loop/__init__.py": "", "glue/loop/b.py": "import glue.loop.c\n",
                      "glue/loop/c.py": "def f():\n    from glue.loop import b\n",
                      "launch/plan/__init__.py": "", "launch/plan/d.py": "from launch.run import e\n",
                      "launch/run/__init__.py": "", "launch/run/e.py": "from launch.config import X\n",
                      "weight_sync/f.py": "import launch.run.e\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert wing_violations() == ["glue/fleet/a.py:1: fleet -> loop (glue.loop.b)",
                                 "launch/plan/d.py:1: plan -> run (launch.run.e)"]
    assert imports_of_launch_from_below() == ["weight_sync/f.py:1: launch.run.e"]
    assert import_cycles() == [["glue.loop.b", "glue.loop.c"]]


def imports_of_test_modules(source: str) -> list[tuple[str, int]]:
    """(imported test module, line) for every import of a `test_*` / `tests.test_*` module in `source`, function-local
    ones included: `import test_x`, `from test_x import y`, `from tests.test_x import y`, `from tests import test_x`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = f"{node.module}." if node.module else ""
            names = [node.module] if node.module and _is_test_module(node.module) else \
                [prefix + alias.name for alias in node.names]  # `from tests import test_x`, `from . import test_x`
        else:
            continue
        found += [(name, node.lineno) for name in names if _is_test_module(name)]
    return found


def _is_test_module(name: str) -> bool:
    return name.startswith("test_") or name.startswith("tests.test_")


def test_no_test_module_imports_another_test_module():
    """What test modules share lives in tests/helpers (and fixtures in tests/conftest.py): a test module never
    imports another, nor do the helpers import a test module."""
    caught = imports_of_test_modules("import test_a\nfrom tests.test_b import x\n\ndef f():\n    from test_c import y\n"
                                     "from tests import test_d\nfrom helpers.engines import call\n")
    assert sorted(line for _, line in caught) == [1, 2, 5, 6], caught  # the checker sees every form, and only those
    # this file's own folder, not ROOT: the checker test above leaves ROOT at its tmp_path (monkeypatch undoes its
    # setattr before its setitem of the same global)
    tests = Path(__file__).resolve().parent
    files = sorted(tests.rglob("test_*.py")) + sorted((tests / "helpers").glob("*.py")) + [tests / "conftest.py"]
    assert len(files) > 100
    found = [f"{path.relative_to(tests.parent)}:{line} imports {name}"
             for path in files for name, line in imports_of_test_modules(path.read_text())]
    assert not found, "a test module's helper belongs in tests/helpers:\n" + "\n".join(found)


if __name__ == "__main__":
    print("\n".join(wing_violations()))
    print("\n".join(" <-> ".join(g) for g in import_cycles()))
    pytest.main([__file__])




def unexplained_local_imports(root: Path | None = None) -> list[str]:
    """Function-local imports of a project module whose line (the first, for a multi-line one) carries no
    `# lazy: <reason>`: a local import hides an arrow, so it stays only where the import is heavy, optional or would
    close a circle, and says which."""
    root = root or ROOT
    bad = []
    for path in sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    modules = [node.module]
                else:
                    continue
                if any(m.split(".")[0] in PACKAGES for m in modules) and "# lazy:" not in lines[node.lineno - 1]:
                    bad.append(f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(bad))  # a nested function's import is met once per enclosing function


def test_every_function_local_project_import_says_why_it_is_lazy():
    assert unexplained_local_imports() == []
