"""Pinned dependencies: every requirement setup.py declares has a lower and an upper bound, and constraints.txt (the
exact versions `make` installs, known green) pins each one to a version inside that range."""
import ast
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def declared() -> list[Requirement]:
    """install_requires and every extra of setup.py, read without running it."""
    call = next(node for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    args = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    return [Requirement(r) for r in args["install_requires"] + sum(args["extras_require"].values(), [])]


def pins() -> dict[str, Version]:
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[name.strip().lower().replace("_", "-")] = Version(version.strip())
    return out


def test_every_requirement_has_a_lower_and_an_upper_bound():
    loose = [str(r) for r in declared() if r.name != "transformer-engine"
             and not ({">=", "<"} <= {s.operator for s in r.specifier})]
    assert not loose, f"requirements without both bounds: {loose}"


def test_constraints_pin_every_requirement_inside_its_range():
    exact = pins()
    for requirement in declared():
        if requirement.name == "transformer-engine":  # GPU only; nothing here installs it
            continue
        name = requirement.name.lower()
        assert name in exact, f"{name} has no exact version in constraints.txt"
        assert exact[name] in requirement.specifier, f"constraints.txt pins {name}=={exact[name]}, outside {requirement}"
