"""SGLang server options for `--sglang-*`: read from the installed sglang's own argument definitions and forwarded
to every engine's command line. Options sluice sets itself (model path, host, port, engine layout) are refused.

`ServerArgs` cannot be imported on a CPU machine (it pulls GPU-only packages), so its definition is read with `ast`
from the installed source: the field namespaces listed in `_INPUT_NAMESPACES` (`A[type, "help" | Arg(...)]`
fields) plus the options `ServerArgs.add_cli_args` registers by hand (its deprecated spellings with the successor
it names). Without sglang, `--sglang-*` is forwarded verbatim with a warning.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

from launch.args.options import OptionSpec, key_of

# Options sluice derives itself, by config key -> the sluice setting to use instead.
OWNED = {
    "model_path": "model.path (or model.tiny for a random model)",
    "host": "the placement plan (engines listen on their node's address)",
    "port": "the placement plan (sluice picks a free port per engine)",
    "tp_size": "cluster.engine_tensor_parallel_size (the engine layout)",
    "pp_size": "cluster.engine_tensor_parallel_size (engines are laid out by TP only: an engine with pipeline "
               "stages would join the weight group with ranks sluice does not count)",
    "dp_size": "rollout.num_engines (each engine is one data-parallel replica behind the router)",
    "base_gpu_id": "the placement plan (each engine gets CUDA_VISIBLE_DEVICES from its bundles)",
    "nnodes": "cluster.engine_tensor_parallel_size over cluster.gpus_per_node (an engine spans whole nodes; "
              "cluster.engine_nodes on CPU)",
    "node_rank": "the placement plan (one server per node of an engine, each started with its --node-rank)",
    "dist_init_addr": "the placement plan (node rank 0's node address and a port free there, at start-up)",
    "config": "the sglang: section of the sluice YAML (so every option is validated)",
}
_SCALARS = {"int": int, "float": float, "str": str}
# Earlier SGLang spellings that the installed one renamed with the same meaning (slime's scripts still pass them):
# old key -> (new key, the new value for a switch's true, or None to keep the value). CUDA graphs were captured for
# decode only before prefill got graphs of its own (cuda_graph_*_prefill), and --enable-deepep-moe became one value
# of --moe-a2a-backend.
RENAMED: dict[str, tuple[str, Any]] = {
    "cuda_graph_bs": ("cuda_graph_bs_decode", None),
    "cuda_graph_max_bs": ("cuda_graph_max_bs_decode", None),
    "enable_deepep_moe": ("moe_a2a_backend", "deepep"),
}


def renamed_to_installed(values: dict[str, Any], specs: dict[str, OptionSpec]) -> dict[str, Any]:
    """`values` (the sglang: section) with each renamed spelling the installed sglang lacks moved to its new key,
    one note line on stderr per move saying so (as SGLang says of its own deprecated spellings)."""
    out = dict(values)
    for old, (new, switch_value) in RENAMED.items():
        if old not in out or old in specs or new not in specs:
            continue
        value = out.pop(old)
        if switch_value is not None:
            if value is not True:
                continue  # a switch given false sets nothing
            value = switch_value
        if new in out and out[new] != value:
            raise ValueError(f"--sglang-{old.replace('_', '-')} (the installed sglang's --{new.replace('_', '-')}) "
                             f"and --sglang-{new.replace('_', '-')} are both given, with different values; keep one")
        out[new] = value
        shown = "" if switch_value is None else f" {value}"
        print(f"sluice: note: --sglang-{old.replace('_', '-')} is --sglang-{new.replace('_', '-')}{shown} in the "
              "installed sglang (renamed, same meaning): passed as that", file=sys.stderr)
    return out


@functools.cache
def sglang_options() -> dict[str, OptionSpec] | None:
    """Every SGLang server option by config key, or None when sglang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    server_args = root / "srt" / "server_args.py"
    tree = ast.parse(server_args.read_text())
    options: dict[str, OptionSpec] = {}
    for module, class_name in _input_namespaces(tree):
        path = root.parent / (module.replace(".", "/") + ".py")
        for spec_ in _namespace_options(ast.parse(path.read_text()), class_name):
            options.setdefault(spec_.key, spec_)
    for spec_ in _manual_options(tree):
        options.setdefault(spec_.key, spec_)
    if len(options) < 100:
        raise RuntimeError(f"read only {len(options)} options from {server_args}: the installed sglang's argument "
                           "layout is not the one sluice knows; update launch/args/sglang.py")
    return options


def _input_namespaces(tree: ast.Module) -> list[tuple[str, str]]:
    """(module, class) of each name in `_INPUT_NAMESPACES = [...]`, resolved through the file's imports."""
    imported = {alias.asname or alias.name: node.module for node in tree.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                 for t in node.targets)):
            return [(imported[elt.id], elt.id) for elt in node.value.elts]
    raise RuntimeError("sglang/srt/server_args.py has no _INPUT_NAMESPACES list; update launch/args/sglang.py")


def _namespace_options(tree: ast.Module, class_name: str) -> list[OptionSpec]:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = []
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(stmt.annotation, ast.Subscript) and _name(stmt.annotation.value) in ("A", "Annotated")):
            continue
        parts = stmt.annotation.slice.elts if isinstance(stmt.annotation.slice, ast.Tuple) else []
        if len(parts) < 2:
            continue
        meta = _arg_meta(parts[1])
        if meta is None or meta.get("no_cli"):
            continue
        default = _literal(stmt.value) if stmt.value is not None else None
        out.append(_spec(stmt.target.id, parts[0], meta, default))
    return out


def _arg_meta(node: ast.AST) -> dict[str, Any] | None:
    """`"help"` or `Arg(help=..., ...)` -> a dict of the keywords we use (values we cannot evaluate are dropped)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {"help": node.value}
    if isinstance(node, ast.Call) and _name(node.func) == "Arg":
        meta = {}
        for kw in node.keywords:
            if isinstance(kw.value, ast.Dict):  # action_kwargs={"type": str, "nargs": "*"}
                meta[kw.arg] = {_literal(k): _literal(v) for k, v in zip(kw.value.keys, kw.value.values)}
                continue
            value = _literal(kw.value)
            meta[kw.arg] = value if value is not _UNKNOWN else _name(kw.value) or "?"
        return meta
    return None


def _spec(field: str, type_node: ast.AST, meta: dict[str, Any], default: Any) -> OptionSpec:
    flag = meta.get("cli_name") or "--" + field.replace("_", "-")
    inner, literal_choices = _unwrap(type_node)
    action = meta.get("action")
    choices = meta.get("choices") if isinstance(meta.get("choices"), list) else literal_choices
    # SGLang's parser types a List[X] field's values as X (arg_utils.add_cli_args_from_dataclass)
    one = _list_element(type_node) if inner == "list" else inner
    scalar = _SCALARS.get(one, str) if not meta.get("type_parser") else str
    nargs = meta.get("nargs")
    if isinstance(action, str) and action.endswith("BooleanOptionalAction"):
        takes, negatable = "none", True
    elif action is not None:
        takes, negatable = _takes((meta.get("action_kwargs") or {}).get("nargs")), False
    elif literal_choices is not None:
        takes, negatable = "one", False
    elif inner == "list" and not meta.get("type_parser"):
        takes, negatable = _takes(nargs or "+"), False
    elif inner == "bool":
        takes, negatable = "none", False
    else:
        takes, negatable = _takes(nargs), False
    return OptionSpec(key=key_of(flag), flag=flag, takes=takes, scalar=scalar if takes != "none" else bool,
                      choices=tuple(choices) if choices else None,
                      default=default if default is not _UNKNOWN else None, help=str(meta.get("help", "")),
                      aliases=tuple(meta.get("aliases") or ()), negatable=negatable)


def _takes(nargs: Any) -> str:
    return {None: "one", "?": "optional", "+": "many", "*": "any"}.get(nargs, "many")


def _unwrap(node: ast.AST) -> tuple[str, list | None]:
    """The inner type name of `Optional[X]` / `X` ('int', 'bool', 'list', ...) and Literal choices if any."""
    while isinstance(node, ast.Subscript) and _name(node.value) == "Optional":
        node = node.slice
    if isinstance(node, ast.Subscript):
        head = _name(node.value)
        if head == "Literal":
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return "literal", [_literal(e) for e in elts]
        if head in ("List", "list"):
            return "list", None
        if head == "Union":
            elts = [e for e in node.slice.elts if not (isinstance(e, ast.Constant) and e.value is None)
                    and _name(e) != "None"]
            return _unwrap(elts[0]) if len(elts) == 1 else ("union", None)
        return head or "?", None
    return _name(node) or "?", None


def _list_element(node: ast.AST) -> str:
    """The element type name of `Optional[List[X]]` / `List[X]` ('int', 'str', ...)."""
    while isinstance(node, ast.Subscript) and _name(node.value) == "Optional":
        node = node.slice
    return _name(node.slice) or "?" if isinstance(node, ast.Subscript) else "?"


def _manual_options(tree: ast.Module) -> list[OptionSpec]:
    """The `parser.add_argument(...)` calls in `ServerArgs.add_cli_args` (dynamic choices, deprecated spellings)."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    func = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    out = []
    for call in ast.walk(func):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"):
            continue
        flags = [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        if not flags:
            continue
        kw = {k.arg: k.value for k in call.keywords}
        action = kw.get("action")
        action = action.value if isinstance(action, ast.Constant) else _name(action) if action else None
        nargs = _literal(kw["nargs"]) if "nargs" in kw else None
        if action in ("store_true", "store_false") or (isinstance(action, str) and action.endswith("StoreTrueAction")):
            takes = "none"
        else:
            takes = _takes(nargs)
        scalar = _SCALARS.get(_name(kw.get("type", ast.Name("str"))) or "str", str)
        choices = _literal(kw["choices"]) if "choices" in kw else None
        help_ = _literal(kw["help"]) if "help" in kw else ""
        successor = _literal(kw["new_flag"]) if "new_flag" in kw else None  # SGLang's Deprecated*Action spellings
        out.append(OptionSpec(key=key_of(flags[0]), flag=flags[0], takes=takes, scalar=bool if takes == "none" else scalar,
                              choices=tuple(choices) if isinstance(choices, list) else None,
                              help=help_ if isinstance(help_, str) else "", aliases=tuple(flags[1:]),
                              successor=successor if isinstance(successor, str) else None))
    return out


_UNKNOWN = object()


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNKNOWN


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None
