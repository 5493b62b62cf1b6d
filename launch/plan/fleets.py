"""The engine fleets of a run plan: the policy's, and the fleets beside it (`teacher:`, `judge:`), each on bundles of
the one placement group. A fleet beside the policy's gets bundles of its own after the trainer's and the policy
engines' (never shared: its weights never change and it serves while the trainer trains), engines of its own TP on
them, and the policy engines' program and flags less the ones that describe the policy.

Pure: imports no Ray. `launch.plan.run_plan` builds the plan with it; the runner starts each fleet on its bundles."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from glue.fleet.processes import engine_seed
from launch.plan.engine_nodes import NodeRank, gpu_nodes, plan_node_ranks

HOST, PORT = "HOST", "PORT"  # placeholders: the runner picks them at start-up
# flags of the policy's engines that describe the policy (MoE routing replay, the colocated trainer's hand-over), not
# a fleet beside it
POLICY_ONLY_FLAGS = ("--enable-return-routed-experts", "--enable-memory-saver")
SIDE_FLEETS = ("teacher", "judge")  # the sections that bring a fleet of their own, in bundle order


@dataclass
class EngineLaunch:
    index: int
    bundles: list[int]
    node: int | None
    devices: list[int] | None  # GPU indices on the node (CUDA_VISIBLE_DEVICES), None on CPU
    command: list[str]  # full command line, with HOST / PORT placeholders (node rank 0's, when it spans nodes)
    node_ranks: list[NodeRank] = field(default_factory=list)  # one server process per node; [] on one node

    def rank_bundles(self, rank: int) -> list[int]:
        """The bundles of node rank `rank`'s process (every bundle of an engine on one node)."""
        return self.node_ranks[rank].bundles if self.node_ranks else self.bundles


@dataclass
class SideFleet:
    """A fleet beside the policy's: `name` is its config section, `tp` its engines' --tp-size, `seed` the base of
    its engines' --random-seed (glue.fleet.fleet.engine_seed), `engine_args` its flags after --model-path/--host/
    --port."""

    name: str
    tp: int
    engines: list[EngineLaunch]
    engine_args: list[str]
    seed: str
    nodes: int = 1  # nodes each of its engines spans (a server per node)

    @property
    def bundles(self) -> list[int]:
        return [b for e in self.engines for b in e.bundles]


def fleet_sizes(cfg: Any) -> dict[str, tuple[int, int]]:
    """{section: (engines, TP)} of every fleet beside the policy's that the run has, in bundle order. `cfg` is a
    launch.config.SluiceConfig."""
    sizes = {}
    for name in SIDE_FLEETS:
        section = getattr(cfg, name)
        if section is not None and cfg.run.mode != "sft":
            sizes[name] = (section.num_engines, section.tensor_parallel_size or cfg.cluster.engine_tensor_parallel_size)
    return sizes


def check_side_fleets(cfg: Any) -> None:
    """`<section>.gpus` agrees with its engines, and the embedded engine (CPU) runs an engine TP > 1 only as the
    strict engine; ValueError naming the keys."""
    for name, (count, tp) in fleet_sizes(cfg).items():
        gpus = getattr(cfg, name).gpus
        if gpus is not None and gpus != count * tp:
            raise ValueError(f"{name}.gpus={gpus} but {name}.num_engines x tensor_parallel_size = {count} x {tp} = "
                             f"{count * tp}; make them agree (or leave {name}.gpus null)")
        if tp != 1 and cfg.cluster.engine_server == "embedded" and cfg.cluster.engine != "sglang_strict":
            raise ValueError(f"{name}.tensor_parallel_size={tp}: the embedded engine (CPU) runs one process per "
                             f"engine; set {name}.tensor_parallel_size=1, cluster.engine=sglang_strict, or "
                             "cluster.engine=sglang "
                             "on a GPU cluster")


def side_fleet_gpus(cfg: Any) -> dict[str, int]:
    """{section: devices of its fleet}."""
    return {name: count * tp for name, (count, tp) in fleet_sizes(cfg).items()}


def side_engine_args(policy_args: list[str], tp: int) -> list[str]:
    """The policy engines' flags with this fleet's --tp-size and without the flags that describe the policy."""
    args = [a for a in policy_args if a not in POLICY_ONLY_FLAGS]
    if "--tp-size" in args:
        args[args.index("--tp-size") + 1] = str(tp)
    return args


def plan_side_fleets(cfg: Any, *, first_bundle: int, slots: list[tuple[int | None, int | None]],
                     engine_command: list[str], policy_args: list[str], seed: int, run_dir: Any) -> list[SideFleet]:
    """Each fleet on the bundles after `first_bundle` (those of the trainer and the policy engines end there), in
    SIDE_FLEETS order; on GPUs an engine lies within one node, or (TP beyond a node) on whole nodes, a server per
    node (ValueError naming the figures)."""
    fleets, bundle, c = [], first_bundle, cfg.cluster
    for name, (count, tp) in fleet_sizes(cfg).items():
        args, base = side_engine_args(policy_args, tp), f"{seed}:{name}"
        # within a node, any TP whose bundles fit one (as before); beyond a node, whole nodes
        nodes = gpu_nodes(tp, c.gpus_per_node, f"{name}.tensor_parallel_size") if 0 < c.gpus_per_node < tp else 1
        engines = []
        for e in range(count):
            bundles = list(range(bundle, bundle + tp))
            bundle += tp
            spans = sorted({slots[b][0] for b in bundles})
            if c.uses_gpus and len(spans) > 1 and (nodes == 1 or bundles[0] % c.gpus_per_node):
                fit = (f"{name}.tensor_parallel_size={tp}" if nodes == 1 else f"cluster.gpus_per_node="
                       f"{c.gpus_per_node} (an engine over whole nodes starts on a node's first GPU)")
                raise ValueError(f"{name} engine {e} would span nodes {spans[0]} and {spans[-1]}: its {tp} GPUs "
                                 f"(bundles {bundles[0]}-{bundles[-1]}) follow the {first_bundle} of the trainer and "
                                 f"the policy engines on {c.gpus_per_node}-GPU nodes; make those a multiple of {fit}")
            devices = [slots[b][1] for b in bundles] if c.uses_gpus else None
            command = [*engine_command, "--model-path", side_model_path(cfg, name, run_dir), "--host", HOST,
                       "--port", PORT, *args, f"--random-seed={engine_seed(base, e)}"]
            ranks = plan_node_ranks(bundles, command, nodes, slots, c.uses_gpus)
            engines.append(EngineLaunch(index=e, bundles=bundles, node=slots[bundles[0]][0], devices=devices,
                                        command=ranks[0].command if ranks else command, node_ranks=ranks))
        fleets.append(SideFleet(name=name, tp=tp, engines=engines, engine_args=args, seed=base, nodes=nodes))
    return fleets


def side_model_path(cfg: Any, name: str, run_dir: Any) -> str:
    """The checkpoint a fleet beside the policy's serves: its path, or where the run writes it at start-up."""
    if name == "teacher":
        return cfg.teacher.path or str(run_dir / "teacher_model")
    return cfg.judge.model.path or str(run_dir / "judge_model")


def devices_text(plan: Any, bundles: list[int]) -> str:
    """`node 0 gpus 4-5 (bundles 6-7)` (consecutive GPUs of one node), `cpu bundles 2-3` (consecutive CPU bundles),
    else each bundle's device (`RunPlan.device_of`)."""
    slots = [plan.bundle_slots[b] for b in bundles]
    gpus = [gpu for _, gpu in slots]
    nodes = {node for node, _ in slots}
    named = f"bundle {bundles[0]}" if len(bundles) == 1 else f"bundles {bundles[0]}-{bundles[-1]}"
    if bundles != list(range(bundles[0], bundles[0] + len(bundles))):
        return ", ".join(plan.device_of(b) for b in bundles)
    if None in gpus:
        return f"cpu {named}"
    if len(nodes) == 1 and gpus == list(range(gpus[0], gpus[0] + len(gpus))):
        span = f"gpu {gpus[0]}" if len(gpus) == 1 else f"gpus {gpus[0]}-{gpus[-1]}"
        return f"node {nodes.pop()} {span} ({named})"
    if len(nodes) > 1:  # an engine that spans nodes: each node's part
        return ", ".join(devices_text(plan, part) for part in node_parts(plan, bundles))
    return ", ".join(plan.device_of(b) for b in bundles)


def node_parts(plan: Any, bundles: list[int]) -> list[list[int]]:
    """`bundles` cut where the node changes."""
    parts: list[list[int]] = []
    for b in bundles:
        if not parts or plan.bundle_slots[b][0] != plan.bundle_slots[parts[-1][-1]][0]:
            parts.append([])
        parts[-1].append(b)
    return parts
