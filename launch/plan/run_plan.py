"""Resolve a loaded config into a run plan: pass-through values checked against Megatron / SGLang / sgl-router,
cross-section rules checked (parallel sizes vs devices, engine layout, placement), and the placement computed:
one bundle per device, trainer ranks and engines on bundles, the engine and router command lines.

Pure: starts nothing and imports no Ray. `sluice --dry-run` prints `RunPlan.to_dict()`; the runner follows it.
"""
from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from glue.embedded_engine.__main__ import parse_args
from glue.fleet.fleet import EMBEDDED_ENGINE, ROUTER, SGLANG_SERVER
from glue.fleet.processes import engine_seed
from launch.args import router as router_args
from launch.args import sglang as sglang_args
from launch.config import ConfigError, SluiceConfig
from launch.plan.engine_nodes import engine_nodes, node_rank_lines, plan_node_ranks
from launch.plan.fleets import (HOST, PORT, EngineLaunch, SideFleet, check_side_fleets, devices_text,
                                plan_side_fleets, side_fleet_gpus)
from launch.args.megatron import check_megatron
from launch.plan.ipc_sources import settle_ipc
from launch.args.options import check_values, to_argv


@dataclass
class TrainerRank:
    rank: int
    bundle: int
    node: int | None  # None: CPU bundles spread over several nodes, Ray picks which
    device: int | None  # GPU index on the node; None for a CPU bundle
    coords: dict[str, int]  # tp / cp / dp / pp coordinate (megatron's default tp-cp-ep-dp-pp order)


@dataclass
class RunPlan:
    placement: str
    device: str  # "gpu" or "cpu"
    num_nodes: int
    bundles: list[dict[str, float]]  # Ray resources of each placement-group bundle
    bundle_slots: list[tuple[int | None, int | None]]  # (node, device) each bundle stands for, after the stable sort
    trainer: list[TrainerRank]
    engines: list[EngineLaunch]
    engine_command: list[str]  # program + flags shared by every engine (before --model-path/--host/--port)
    engine_args: list[str]  # flags after them: sluice's engine layout + the --sglang-* pass-through
    engine_seed: int  # the fleet's seed: engine i's start n gets --random-seed glue.fleet.fleet.engine_seed(it, i, n)
    router_command: list[str]  # full router command line, with placeholders
    router_args: list[str]  # the --router-* pass-through
    notes: list[str] = field(default_factory=list)  # valid for the backends, not runnable by this build
    models_devices: bool = False  # CPU bundles stand for an SGLang run's GPUs (strict engines): see `device_of`
    side_fleets: list[SideFleet] = field(default_factory=list)  # teacher / judge fleets, on bundles of their own
    engine_nodes: int = 1  # nodes each policy engine spans: a server process per node (EngineLaunch.node_ranks)
    transport_reason: str = ""  # why sync.transport is not its default (launch.plan.ipc_sources.settle_ipc)

    def side_fleet(self, name: str) -> SideFleet:
        """The fleet of section `name` ("teacher" or "judge")."""
        found = [f for f in self.side_fleets if f.name == name]
        assert found, f"the plan has no {name} fleet (fleets: {[f.name for f in self.side_fleets]})"
        return found[0]

    def device_of(self, bundle: int) -> str:
        """The device bundle `bundle` is (`node 0 gpu 3`) or, on CPU, stands for (`cpu bundle 3`: one bundle per
        device). With `models_devices` every weight-group member carries it and a group refuses two members on one,
        as NCCL does on GPU (weight_sync.process_group)."""
        node, gpu = self.bundle_slots[bundle]
        return f"node {node} gpu {gpu}" if gpu is not None else f"cpu bundle {bundle}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "placement": self.placement, "device": self.device, "num_nodes": self.num_nodes,
            "placement_group": {"bundles": len(self.bundles), "bundle": self.bundles[0] if self.bundles else {}},
            "trainer": [f"rank {r.rank}: bundle {r.bundle}, node {_node(r.node)}, {_where(r.device)}, "
                        + " ".join(f"{k}={v}" for k, v in r.coords.items()) for r in self.trainer],
            "engines": _engine_dicts(self, self.engines),
            "router": shlex.join(self.router_command),
            **{f"{f.name}_engines": _engine_dicts(self, f.engines) for f in self.side_fleets},
            **({"devices": "modeled: each weight-group member carries its bundle's device and a group refuses two "
                           "members on one, as NCCL does on GPU"} if self.models_devices else {}),
            "notes": self.notes,
        }


def _engine_dicts(plan: RunPlan, engines: list[EngineLaunch]) -> list[dict[str, Any]]:
    """An engine per entry; one that spans nodes lists its node ranks, and its command is node rank 0's (the others
    differ in --node-rank alone)."""
    return [{"engine": e.index, "bundles": e.bundles, "node": _node(e.node),
             "devices": e.devices if e.devices is not None else "cpu", "command": shlex.join(e.command),
             **({"node_ranks": node_rank_lines(e.node_ranks, lambda b: devices_text(plan, b))} if e.node_ranks else {})}
            for e in engines]


def _where(device: int | None) -> str:
    return "cpu" if device is None else f"gpu {device}"


def _node(node: int | None) -> int | str:
    return "any (Ray spreads CPU bundles over the nodes)" if node is None else node


def resolve(cfg: SluiceConfig) -> tuple[SluiceConfig, RunPlan]:
    """Check pass-through values and cross-section rules, return the checked config and its plan.
    Raises ConfigError with the key and the fix."""
    try:
        cfg = _checked_passthrough(cfg)
        colocated_sglang = cfg.cluster.placement == "colocated" and cfg.cluster.engine_kind == "sglang"
        cfg = dataclasses.replace(cfg, sync=dataclasses.replace(
            cfg.sync, max_staleness=max_staleness(cfg), pause_mode=pause_mode(cfg),
            transport=cfg.sync.chosen_transport(colocated_sglang)))
        _check_layout(cfg)
        return settle_ipc(cfg, _plan(cfg))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _checked_passthrough(cfg: SluiceConfig) -> SluiceConfig:
    trainer = dataclasses.replace(cfg.trainer, megatron=check_megatron(cfg.trainer.megatron))
    sglang_specs = sglang_args.sglang_options()
    sglang = dict(cfg.sglang)
    if sglang_specs is None:
        if sglang:
            print("sluice: warning: sglang is not installed, so sglang.* / --sglang-* options are forwarded verbatim "
                  "without validation", file=sys.stderr)
        bad = sorted(set(sglang) & set(sglang_args.OWNED))
        if bad:
            raise ValueError(f"--sglang-{bad[0].replace('_', '-')} is set by sluice itself; use {sglang_args.OWNED[bad[0]]}")
    else:
        sglang = check_values(sglang_args.renamed_to_installed(sglang, sglang_specs), sglang_specs, section="sglang",
                              prefix="sglang", owned=sglang_args.OWNED)
    router_specs = router_args.router_options()
    router = dict(cfg.router)
    if router_specs is not None:
        router = check_values(router, router_specs, section="router", prefix="router", owned=router_args.OWNED)
    return dataclasses.replace(cfg, trainer=trainer, sglang=sglang, router=router)


def max_staleness(cfg: SluiceConfig) -> int:
    """sync.max_staleness, or the mode's default: 0 (on-policy) for sync, 1 for async."""
    if cfg.sync.max_staleness is not None:
        return cfg.sync.max_staleness
    return 0 if cfg.run.mode == "sync" else 1


def pause_mode(cfg: SluiceConfig) -> str:
    """sync.pause_mode, or the engines' default: SGLang servers answer one weight_version per request, so a request
    must not run across a sync (abort, and the rollout function resumes it); the embedded engine stamps every token,
    so retract (no client resume, KV recomputed on the new weights) is exact there. Restarting partial rollouts
    needs abort."""
    if cfg.sync.pause_mode is not None:
        return cfg.sync.pause_mode
    if cfg.cluster.engine_kind == "sglang" or cfg.sync.partial_rollouts == "restart":
        return "abort"
    return "retract"


def _check_staleness(cfg: SluiceConfig) -> None:
    """The staleness gate's settings agree with the mode (one loop: sync is max_staleness 0)."""
    bound, s = cfg.sync.max_staleness, cfg.sync
    if cfg.run.mode == "sync" and bound != 0:
        raise ValueError(f"sync.max_staleness={bound} with run.mode=sync: sync mode trains only on the latest "
                         "weights (max_staleness 0); set run.mode=async to allow stale tokens")
    if not 1 <= s.interval <= bound + 1:
        raise ValueError(f"sync.interval={s.interval} must be in [1, max_staleness + 1 = {bound + 1}]: after "
                         "max_staleness + 1 steps without a sync nothing more may start and the trainer would wait "
                         "forever; raise sync.max_staleness or lower sync.interval")
    if cfg.run.mode == "async" and cfg.cluster.engine_kind == "sglang" and s.pause_mode != "abort":
        raise ValueError(f"sync.pause_mode={s.pause_mode} with SGLang engines in async mode: SGLang answers one "
                         "weight_version per request, so a request running across a sync could not be split by version; "
                         "use sync.pause_mode=abort (the rollout function resumes aborted requests on the new weights)")
    if cfg.run.deterministic and s.interval != 1:
        raise ValueError(f"run.deterministic needs sync.interval=1 (got {s.interval}): a resumed run's engines get "
                         "the checkpoint's weights, which is where an uninterrupted run's engines are only when every "
                         "step syncs")
    if cfg.trainer.old_logprobs == "snapshot" and cfg.loss.old_logprobs_from != "given":
        raise ValueError(f"trainer.old_logprobs=snapshot needs loss.old_logprobs_from=given (it is "
                         f"{cfg.loss.old_logprobs_from!r}, which does not read the trainer's old logprobs)")


def _check_sglang_engines(cfg: SluiceConfig) -> None:
    """What cannot work against SGLang 0.5.23 servers, refused before anything starts (the rest is chosen for them
    by default: sync.verify auto checks versions only, sync.pause_mode abort, the weight group's ranks counted
    per engine TP rank, sync.transport ipc when colocated)."""
    s = cfg.sync
    if s.verify in ("checksum", "full"):
        raise ValueError(f"sync.verify={s.verify} with SGLang engines: per-bucket checksums and the HF-named weights "
                         "checker are the embedded engine's; SGLang answers updates with {success, message} and its "
                         "/weights_checker uses its own fused, TP-sharded names. Use sync.verify=auto (versions are "
                         "checked after every sync) or off")
    if s.delta:
        raise ValueError("sync.delta=true with SGLang engines: SGLang 0.5.x loads /update_weights_from_distributed "
                         "through the model's own loader whatever its load_format (a custom weight loader is reached "
                         "only from /update_weights_from_tensor), so it cannot apply delta buckets; use sync.delta="
                         "false (docs/weight_sync.md, 'Delta sync')")
    if s.pause_mode == "in_place":
        raise ValueError("sync.pause_mode=in_place with SGLang engines: the sync's last bucket flushes the prefix "
                         "cache, which SGLang refuses while requests run (and in-place requests keep running across "
                         "the new weights under one reported version); use sync.pause_mode=abort")
    c = cfg.cluster
    if s.transport == "ipc" and c.uses_gpus and c.placement != "colocated":
        raise ValueError("sync.transport=ipc with disaggregated SGLang engines: a CUDA IPC handle opens only on a GPU "
                         "the engine sees, and these engines do not share the trainer's; use sync.transport=broadcast")


def _check_layout(cfg: SluiceConfig) -> None:
    """The rules that span sections; each message names the settings and what to change."""
    t, c = cfg.trainer, cfg.cluster
    sizes = (f"TP x PP x CP x DP = {t.tensor_model_parallel_size} x {t.pipeline_model_parallel_size} x "
             f"{t.context_parallel_size} x {t.data_parallel_size} = {t.world_size}")
    if c.trainer_gpus is not None and c.trainer_gpus != t.world_size:
        raise ValueError(f"{sizes} != cluster.trainer_gpus={c.trainer_gpus}: change the parallel sizes "
                         "(--tensor-model-parallel-size, ..., trainer.data_parallel_size) or cluster.trainer_gpus")
    engine_gpus = _engine_gpus(cfg)
    if engine_gpus % c.engine_tensor_parallel_size:
        raise ValueError(f"cluster.engine_tensor_parallel_size={c.engine_tensor_parallel_size} does not divide "
                         f"cluster.engine_gpus={engine_gpus}; every engine needs the same number of GPUs")
    if engine_gpus // c.engine_tensor_parallel_size != num_engines(cfg):
        raise ValueError(f"cluster.engine_gpus={engine_gpus} / engine_tensor_parallel_size="
                         f"{c.engine_tensor_parallel_size} = {engine_gpus // c.engine_tensor_parallel_size} engines, "
                         f"but rollout.num_engines={cfg.rollout.num_engines}; make them agree")
    if cfg.run.mode == "async" and c.placement == "colocated":
        raise ValueError("run.mode=async needs cluster.placement=disaggregated: colocated engines and trainer take "
                         "turns on the same devices, so they cannot run at the same time")
    _check_staleness(cfg)
    engine_nodes(c)  # an engine spans whole nodes, or one
    check_side_fleets(cfg)
    if c.engine_kind == "sglang":
        _check_sglang_engines(cfg)
    if c.uses_gpus:
        _check_gpu_counts(cfg, engine_gpus)
    elif c.num_nodes > 1 and _num_bundles(cfg, engine_gpus) < c.num_nodes:
        raise ValueError(f"cluster.num_nodes={c.num_nodes} but the run has only {_num_bundles(cfg, engine_gpus)} "
                         "CPU bundles (trainer ranks + engines of every fleet): some node would get none; lower "
                         "cluster.num_nodes")
    if not c.uses_gpus and c.cpus_per_bundle < t.num_cpus_per_worker:
        raise ValueError(f"cluster.cpus_per_bundle={c.cpus_per_bundle:g} < trainer.num_cpus_per_worker="
                         f"{t.num_cpus_per_worker:g}: a trainer rank would never fit its bundle; raise the first")
    if c.engine_server == "embedded":
        _check_embedded_engine(cfg)
    if cfg.run.cluster_address is None:
        needed = _num_bundles(cfg, engine_gpus) * c.cpus_per_bundle
        if needed > cfg.run.ray_num_cpus:
            raise ValueError(f"the placement group needs {needed:g} CPUs but the local Ray cluster has "
                             f"run.ray_num_cpus={cfg.run.ray_num_cpus}; raise it or lower cluster.cpus_per_bundle")


def num_engines(cfg: SluiceConfig) -> int:
    """The engines the run starts: rollout.num_engines, none in run.mode sft (the trainer alone runs)."""
    return 0 if cfg.run.mode == "sft" else cfg.rollout.num_engines


def _engine_gpus(cfg: SluiceConfig) -> int:
    c = cfg.cluster
    if c.engine_gpus is not None and num_engines(cfg):
        return c.engine_gpus
    return num_engines(cfg) * c.engine_tensor_parallel_size


def _num_bundles(cfg: SluiceConfig, engine_gpus: int) -> int:
    """Bundles of the trainer and the policy engines (shared when colocated), then those of the fleets beside."""
    return _policy_bundles(cfg, engine_gpus) + sum(side_fleet_gpus(cfg).values())


def _policy_bundles(cfg: SluiceConfig, engine_gpus: int) -> int:
    trainer = cfg.trainer.world_size
    return max(trainer, engine_gpus) if cfg.cluster.placement == "colocated" else trainer + engine_gpus


def _check_gpu_counts(cfg: SluiceConfig, engine_gpus: int) -> None:
    c, trainer = cfg.cluster, cfg.trainer.world_size
    total = c.num_nodes * c.gpus_per_node
    side = side_fleet_gpus(cfg)
    beside = "".join(f" + {name} {gpus}" for name, gpus in side.items())
    lower = "".join(f" / {name}.num_engines" for name in side)
    asked = _num_bundles(cfg, engine_gpus)
    if c.placement == "colocated" and asked > total:
        shared = (f"max(trainer {trainer}, engines {engine_gpus}){beside} = {asked} GPUs" if side else
                  f"{asked} GPUs (trainer {trainer}, engines {engine_gpus}, shared)")
        raise ValueError(f"colocated placement asks for {shared} but cluster.num_nodes x gpus_per_node = {total}; lower "
                         f"the parallel sizes / rollout.num_engines{lower} or add nodes")
    if c.placement == "disaggregated" and asked > total:
        raise ValueError(f"disaggregated placement asks for trainer {trainer} + engines {engine_gpus}{beside} = "
                         f"{asked} GPUs but cluster.num_nodes x gpus_per_node = {total}; lower the parallel sizes / "
                         f"rollout.num_engines{lower}, add nodes, or use cluster.placement=colocated")


def _check_embedded_engine(cfg: SluiceConfig) -> None:
    """The CPU stand-in speaks SGLang's API but implements few of its options: refuse the rest before start-up."""
    import contextlib
    import io

    if cfg.cluster.engine_tensor_parallel_size != 1 and cfg.cluster.engine != "sglang_strict":
        raise ValueError("the embedded engine (CPU) runs one process per engine: set "
                         "cluster.engine_tensor_parallel_size=1, cluster.engine=sglang_strict (which simulates engine "
                         "TP in the weight groups), or cluster.engine=sglang on a GPU cluster")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(["--model-path", "unused", *to_argv(cfg.sglang, sglang_args.sglang_options())])
    except SystemExit:
        reason = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "rejected"
        raise ValueError(f"the embedded engine (used on CPU) does not implement these sglang options: {reason}; "
                         "drop them from sglang: / --sglang-*, or run SGLang servers on GPU (cluster.gpus_per_node)"
                         ) from None


def _plan(cfg: SluiceConfig) -> RunPlan:
    c, engine_gpus = cfg.cluster, _engine_gpus(cfg)
    n_bundles = _num_bundles(cfg, engine_gpus)
    # GPU bundles fill node after node; CPU bundles on several nodes are spread over them by Ray (node unknown here)
    cpu_node = 0 if c.num_nodes == 1 else None
    slots = [(b // c.gpus_per_node, b % c.gpus_per_node) if c.uses_gpus else (cpu_node, None) for b in range(n_bundles)]
    resources = {"GPU": 1.0, "CPU": c.cpus_per_bundle} if c.uses_gpus else {"CPU": c.cpus_per_bundle}
    # Engines take the first bundles (the driver's node sorts first, near the router); each is started on its
    # bundle's node by a host actor, so engines may spread over nodes.
    # Colocated: trainer rank r shares bundle r with an engine; glue.loop.colocation hands the device over per phase.
    first = 0 if c.placement == "colocated" else engine_gpus
    trainer = [TrainerRank(rank=r, bundle=first + r, node=slots[first + r][0], device=slots[first + r][1],
                           coords=_coords(cfg, r)) for r in range(cfg.trainer.world_size)]
    engine_command = list(SGLANG_SERVER if c.engine_server == "sglang" else EMBEDDED_ENGINE)
    layout = ["--tp-size", str(c.engine_tensor_parallel_size)] if c.engine_kind == "sglang" else []
    if c.engine == "sglang_strict":
        layout.append("--sglang-strict")
    if c.engine_kind == "sglang" and c.placement == "colocated" and "enable_memory_saver" not in cfg.sglang:
        layout.append("--enable-memory-saver")  # without it SGLang's release/resume memory routes do nothing
    if c.engine_server == "sglang":  # token ids in every OpenAI-style answer: the router drops the per-request opt-ins
        known = sglang_args.sglang_options() or {}  # an SGLang without these switches is left as it is
        layout += [f"--{k.replace('_', '-')}" for k in ("return_input_ids", "return_output_ids")
                   if k in known and k not in cfg.sglang]
    if cfg.run.deterministic and "enable_deterministic_inference" not in cfg.sglang:
        layout.append("--enable-deterministic-inference")  # the embedded engine takes SGLang's flag too
    if (cfg.trainer.precision == "bf16" or cfg.trainer.requests_bf16()) and "dtype" not in cfg.sglang:
        layout += ["--dtype", "bfloat16"]  # engines serve the weights the bf16 trainer sends (SGLang's auto: fp16 for fp32)
    if cfg.rollout.return_routed_experts and "enable_return_routed_experts" not in cfg.sglang:
        layout.append("--enable-return-routed-experts")  # MoE routing replay (R3): engines record top-k per token
    # --random-seed is per engine (glue.fleet.fleet.engine_seed): one seed for all would give their k-th requests the same
    # draws; sglang.random_seed, if given, is the fleet's base instead of run.seed
    seed = int(cfg.sglang.get("random_seed", cfg.run.seed))
    engine_args = layout + to_argv({k: v for k, v in cfg.sglang.items() if k != "random_seed"},
                                   sglang_args.sglang_options())
    engines = _plan_engines(cfg, slots, [*engine_command, "--model-path", cfg.model.path or str(
        cfg.run_dir / "init_model"), "--host", HOST, "--port", PORT, *engine_args], seed)
    # The router logs one INFO line per request (11 MB in one demo): warnings and errors only, unless router.log_level
    router_argv = (["--log-level", "warn"] if "log_level" not in cfg.router else []) + to_argv(
        cfg.router, router_args.router_options())
    router_command = [*ROUTER, "--host", HOST, "--port", PORT, "--policy", cfg.rollout.router_policy,
                      "--worker-urls", *[f"http://{HOST}:{PORT}" for _ in engines], *router_argv] if engines else []
    side_fleets = plan_side_fleets(cfg, first_bundle=_policy_bundles(cfg, engine_gpus), slots=slots,
                                   engine_command=engine_command, policy_args=engine_args, seed=seed,
                                   run_dir=cfg.run_dir)
    notes = cfg.trainer.unsupported()
    if cfg.loss.kl_reward_coef > 0:
        notes.append("loss.kl_reward_coef > 0: the trainer has no reference logprobs before the advantages are "
                     "computed yet; use loss.kl_loss_coef (KL as a loss term)")
    return RunPlan(placement=c.placement, device="gpu" if c.uses_gpus else "cpu", num_nodes=c.num_nodes,
                   bundles=[dict(resources) for _ in range(n_bundles)], bundle_slots=slots, trainer=trainer,
                   engines=engines, engine_command=engine_command, engine_args=engine_args, engine_seed=seed,
                   router_command=router_command, router_args=router_argv, notes=notes,
                   models_devices=c.engine == "sglang_strict" and not c.uses_gpus, side_fleets=side_fleets,
                   engine_nodes=engine_nodes(c))


def _plan_engines(cfg: SluiceConfig, slots: list[tuple[int | None, int | None]], command: list[str], seed: int
                  ) -> list[EngineLaunch]:
    """The policy engines on the first bundles, each `command` with its --random-seed, and its node ranks when it
    spans nodes (whole ones: the engines start at bundle 0)."""
    c, engines = cfg.cluster, []
    for e in range(num_engines(cfg)):
        bundles = list(range(e * c.engine_tensor_parallel_size, (e + 1) * c.engine_tensor_parallel_size))
        mine = [*command, f"--random-seed={engine_seed(seed, e)}"]
        ranks = plan_node_ranks(bundles, mine, engine_nodes(c), slots, c.uses_gpus)
        engines.append(EngineLaunch(index=e, bundles=bundles, node=slots[bundles[0]][0],
                                    devices=[slots[b][1] for b in bundles] if c.uses_gpus else None,
                                    command=ranks[0].command if ranks else mine, node_ranks=ranks))
    return engines


def _coords(cfg: SluiceConfig, rank: int) -> dict[str, int]:
    """The rank's coordinates as `--dry-run` shows them: the expert ones only with expert parallelism."""
    coords = rank_coords(cfg.trainer, rank)
    return coords if cfg.trainer.expert_model_parallel_size > 1 else {k: coords[k] for k in ("tp", "cp", "dp", "pp")}


def rank_coords(trainer: Any, rank: int) -> dict[str, int]:
    """Where megatron-core puts trainer rank `rank` (a glue.trainer.config.TrainerConfig's layout), in its default
    order tp-cp-ep-dp-pp (TP fastest, PP slowest): tp / cp / dp / pp of the dense layout and, folded into the same
    ranks, ep / etp / edp of the expert layout (expert TP fastest, then EP, then expert DP, within each stage)."""
    t, coords, left = trainer, {}, rank
    for name, size in (("tp", t.tensor_model_parallel_size), ("cp", t.context_parallel_size),
                       ("dp", t.data_parallel_size), ("pp", t.pipeline_model_parallel_size)):
        coords[name], left = left % size, left // size
    etp = t.expert_tensor_parallel_size or t.tensor_model_parallel_size
    local = rank % (t.tensor_model_parallel_size * t.context_parallel_size * t.data_parallel_size)
    coords.update(ep=local // etp % t.expert_model_parallel_size, etp=local % etp,
                  edp=local // (etp * t.expert_model_parallel_size))
    return coords
