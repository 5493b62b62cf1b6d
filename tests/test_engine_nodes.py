"""Engines that span nodes, planned (issue 48 item 4): an SGLang engine whose TP takes more GPUs than a node has is
laid out on whole nodes, one server process per node with SGLang's --nnodes / --node-rank / --dist-init-addr, the
router pointed at node rank 0 alone, and every one of its TP ranks, on every node, a member of the weight group.
A layout that cannot be put on whole nodes is refused in one line naming the figures and the fix."""
from __future__ import annotations

import pytest
import yaml

from launch.cli import main
from launch.config import ConfigError, load_config
from launch.plan.run_plan import resolve
from launch.plan.weight_groups import check_weight_groups, plan_weight_groups
from launch.plan.model_check import model_config

DEMO = "examples/configs/demo.yaml"
# two engines of TP 16 on 8-GPU nodes (nodes 0-1 and 2-3) and one trainer rank on node 4
SPANNING = ["cluster.gpus_per_node=8", "cluster.num_nodes=5", "cluster.engine_tensor_parallel_size=16",
            "rollout.num_engines=2", "sync.backend=nccl", "run.ray_num_cpus=64"]


def test_an_engine_of_tp_16_on_8_gpu_nodes_runs_a_server_per_node_on_whole_nodes_and_the_router_sees_rank_0():
    _, plan = resolve(load_config(DEMO, SPANNING))
    assert plan.engine_nodes == 2
    first, second = plan.engines
    assert [(r.rank, r.node, r.bundles, r.devices) for r in first.node_ranks] == [
        (0, 0, list(range(0, 8)), list(range(8))), (1, 1, list(range(8, 16)), list(range(8)))]
    assert [(r.rank, r.node, r.bundles[0], r.bundles[-1]) for r in second.node_ranks] == [(0, 2, 16, 23),
                                                                                         (1, 3, 24, 31)]
    for k, rank in enumerate(first.node_ranks):  # the same SGLang command, each with its --node-rank
        assert rank.command[-6:] == ["--nnodes", "2", "--node-rank", str(k), "--dist-init-addr",
                                     "RANK0_HOST:DIST_PORT"]
        assert rank.command[:-6] == first.node_ranks[0].command[:-6] and "--tp-size" in rank.command
    assert first.command == first.node_ranks[0].command and first.rank_bundles(1) == list(range(8, 16))
    assert plan.trainer[0].node == 4 and plan.trainer[0].bundle == 32
    # the router gets one worker per engine: node rank 0's url
    assert plan.router_command.count("http://HOST:PORT") == 2
    shown = plan.to_dict()["engines"][0]["node_ranks"]
    assert shown[0] == ("node rank 0 on node 0 gpus 0-7 (bundles 0-7): serves HTTP: the router's worker, control "
                        "and weight endpoints")
    assert shown[1] == ("node rank 1 on node 1 gpus 0-7 (bundles 8-15): joins node rank 0 at --dist-init-addr, serves "
                        "no HTTP")


def test_an_engine_that_fits_a_node_is_planned_as_before_with_no_node_flags():
    _, plan = resolve(load_config(DEMO, ["cluster.gpus_per_node=8", "cluster.engine_tensor_parallel_size=4",
                                         "rollout.num_engines=1"]))
    assert plan.engine_nodes == 1 and plan.engines[0].node_ranks == []
    assert "--nnodes" not in plan.engines[0].command and plan.engines[0].rank_bundles(0) == [0, 1, 2, 3]
    assert "node_ranks" not in plan.to_dict()["engines"][0]


@pytest.mark.parametrize("overrides, message", [
    (["cluster.gpus_per_node=8", "cluster.num_nodes=2", "cluster.engine_tensor_parallel_size=12"],
     "cluster.engine_tensor_parallel_size=12 takes more GPUs than one node's cluster.gpus_per_node=8 but is not a "
     "multiple of it: an engine that spans nodes takes whole nodes (one SGLang server per node); make it 8 or 16"),
    (["cluster.gpus_per_node=8", "cluster.num_nodes=3", "cluster.engine_tensor_parallel_size=16",
      "cluster.engine_nodes=4"],
     "cluster.engine_nodes=4 but an engine of engine_tensor_parallel_size=16 on 8-GPU nodes spans 2; leave "
     "cluster.engine_nodes null on GPUs (it follows from them)"),
    (["cluster.gpus_per_node=8", "cluster.engine_tensor_parallel_size=6"],
     "cluster.engine_tensor_parallel_size=6 does not divide cluster.gpus_per_node=8: an engine would span two "
     "nodes; make it a divisor of 8, or a multiple (an engine on whole nodes)"),
    (["cluster.engine_tensor_parallel_size=2", "cluster.engine_nodes=2"],
     "cluster.engine_nodes=2 on CPU: only strict engines rehearse an engine that spans nodes"),
    (["cluster.engine=sglang_strict", "cluster.engine_tensor_parallel_size=3", "cluster.engine_nodes=2"],
     "cluster.engine_tensor_parallel_size=3 is not a multiple of cluster.engine_nodes=2"),
    (["sglang.nnodes=2"], "--sglang-nnodes (sglang.nnodes) is set by sluice itself; use "
                          "cluster.engine_tensor_parallel_size over cluster.gpus_per_node"),
])
def test_a_layout_that_cannot_span_whole_nodes_is_refused_naming_the_figures_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as err:
        resolve(load_config(DEMO, ["rollout.num_engines=1", "run.ray_num_cpus=64", *overrides]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_weight_group_counts_every_tp_rank_of_an_engine_on_every_node():
    cfg, plan = resolve(load_config(DEMO, SPANNING))
    (group,) = plan_weight_groups(cfg, plan, model_config(cfg))
    assert group.world_size == 1 + 2 * 16
    members = group.members[1:]
    assert [m.rank for m in members] == list(range(1, 33))  # rank_offset + tp_rank, as SGLang's TP workers join
    assert [m.bundle for m in members] == list(range(32))  # engine 0's TP ranks 8-15 stand on node 1's GPUs
    assert [plan.bundle_slots[m.bundle][0] for m in members[:16]] == [0] * 8 + [1] * 8
    assert check_weight_groups(cfg, plan) == "weight groups: 1 (nccl), no two members on one device"


def test_the_dry_run_shows_the_node_ranks_the_fleet_and_the_weight_group_of_a_two_node_engine(capsys):
    assert main(["--dry-run", "--config", DEMO, *SPANNING]) == 0, capsys.readouterr().err
    plan = yaml.safe_load(capsys.readouterr().out)["plan"]
    assert plan["fleets"][0].startswith("policy: 2 engines x TP 16 over 2 nodes (a server per node) on node 0 gpus "
                                        "0-7 (bundles 0-7), node 1 gpus 0-7 (bundles 8-15), node 2 gpus 0-7")
    members = plan["weight_sync"]["groups"][0]["members"]
    assert members[1] == ("ranks 1-16: engine 0, rank_offset 1 (node 0 gpus 0-7, node 1 gpus 0-7); TP ranks 0-7 in "
                          "node rank 0's server, 8-15 in node rank 1's (every one a member)")
    assert members[2].startswith("ranks 17-32: engine 1, rank_offset 17 (node 2 gpus 0-7, node 3 gpus 0-7)")
    assert "(2 nodes x 8, a server per node)" in plan["memory"]["engines"]


def test_strict_engines_on_cpu_rehearse_a_two_node_engine_in_the_plan():
    _, plan = resolve(load_config(DEMO, ["cluster.engine=sglang_strict", "cluster.engine_tensor_parallel_size=2",
                                         "cluster.engine_nodes=2", "rollout.num_engines=1"]))
    (engine,) = plan.engines
    assert plan.engine_nodes == 2 and [r.bundles for r in engine.node_ranks] == [[0], [1]]
    assert engine.node_ranks[1].command[-5:] == ["2", "--node-rank", "1", "--dist-init-addr", "RANK0_HOST:DIST_PORT"]
    assert "--sglang-strict" in engine.node_ranks[1].command


def test_each_node_rank_is_started_on_its_own_nodes_bundle_with_its_own_gpus():
    from launch.run.cluster import Placement
    from launch.run.fleets import engine_env, engine_host_options, node_rank_options

    _, plan = resolve(load_config(DEMO, SPANNING))

    class Bundles(Placement):  # the bundles' Ray options, as launch.run.cluster.Placement pins an actor to one
        def actor_options(self, bundle, *, num_cpus, num_gpus=0):
            return {"bundle": bundle, "num_cpus": num_cpus}

    n = len(plan.bundles)
    placement = Bundles(group=None, ray_bundle=list(range(n)), node_ip=[f"10.0.0.{b // 8}" for b in range(n)],
                        gpu_id=[b % 8 for b in range(n)])
    options = node_rank_options(placement, plan.engines, plan.engine_nodes)
    assert options["engine_nodes"] == 2
    assert options["rank_hosts"] == [[{"bundle": 8, "num_cpus": 0}], [{"bundle": 24, "num_cpus": 0}]]
    assert options["rank_env"] == [[{"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}]] * 2
    assert engine_host_options(placement, plan.engines[1]) == {"bundle": 16, "num_cpus": 0}  # node rank 0's
    assert engine_env(plan, placement, plan.engines[0]) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    _, one_node = resolve(load_config(DEMO, ["cluster.gpus_per_node=8", "cluster.engine_tensor_parallel_size=4",
                                             "rollout.num_engines=1"]))
    # RolloutFleet's defaults: one process per engine
    assert node_rank_options(placement, one_node.engines, one_node.engine_nodes) == {}


def test_a_recipe_whose_engine_spans_nodes_is_rehearsed_with_a_two_node_strict_engine(tmp_path):
    from launch.tools.shrink import shrink

    raw = {"model": {"tiny": {"family": "qwen2"}},
           "cluster": {"num_nodes": 3, "gpus_per_node": 8, "engine_tensor_parallel_size": 16},
           "rollout": {"num_engines": 1}}
    shrunk = shrink(raw, data_dir=tmp_path, engine="sglang_strict")
    assert shrunk.raw["cluster"]["engine_tensor_parallel_size"] == 2
    assert shrunk.record.added["cluster.engine_nodes"] == {
        "to": 2, "why": "an engine over 2 nodes: 2 node-rank processes of a strict engine, one TP rank each"}
    _, plan = resolve(load_config(DEMO, [f"cluster.{k}={v}" for k, v in shrunk.raw["cluster"].items()]
                                  + ["rollout.num_engines=1"]))
    assert plan.engine_nodes == 2 and [r.bundles for r in plan.engines[0].node_ranks] == [[0], [1]]
    lenient = shrink(raw, data_dir=tmp_path, engine="embedded").raw["cluster"]
    assert lenient["engine_tensor_parallel_size"] == 1 and "engine_nodes" not in lenient


def test_a_teacher_engine_wider_than_a_node_spans_whole_nodes_and_one_that_starts_mid_node_is_refused():
    distill = ["cluster.gpus_per_node=4", "cluster.num_nodes=3", "teacher.tensor_parallel_size=8",
               "run.ray_num_cpus=32"]
    _, plan = resolve(load_config("examples/configs/distill.yaml", [*distill, "rollout.num_engines=3"]))
    teacher = plan.side_fleet("teacher")
    assert teacher.nodes == 2 and plan.engine_nodes == 1  # the policy's engines fit a node
    assert [(r.node, r.bundles) for r in teacher.engines[0].node_ranks] == [(1, [4, 5, 6, 7]), (2, [8, 9, 10, 11])]
    assert teacher.engines[0].node_ranks[1].command[-5:-2] == ["2", "--node-rank", "1"]
    with pytest.raises(ConfigError) as err:  # trainer 1 + policy engines 2 end mid-node 0
        resolve(load_config("examples/configs/distill.yaml", distill))
    assert ("teacher engine 0 would span nodes 0 and 2: its 8 GPUs (bundles 3-10) follow the 3 of the trainer and "
            "the policy engines on 4-GPU nodes; make those a multiple of cluster.gpus_per_node=4") in str(err.value)


def test_dp_attention_and_expert_parallelism_inside_the_tp_of_an_engine_over_nodes_reach_every_node_rank():
    _, plan = resolve(load_config(DEMO, SPANNING, flags={"sglang": {"attn_dp_size": 8, "ep_size": 16}}))
    assert plan.engine_nodes == 2 and len(plan.bundles) == 2 * 16 + 1  # the GPUs are the engines' TP, no more
    for rank in plan.engines[0].node_ranks:
        command = " ".join(rank.command)
        assert "--tp-size 16" in command and "--attn-dp-size 8" in command and "--ep-size 16" in command


def test_slimes_deepseek_r1_layout_of_64_gpus_per_engine_plans_two_engines_over_eight_nodes_each():
    from launch.args.command_line import parse_args

    # the cluster flags of slime's scripts/run-deepseek-r1.sh (16 nodes x 8 GPUs, colocated, 64 GPUs per engine)
    args, overrides = parse_args(["--config", DEMO, "--actor-num-nodes", "16", "--actor-num-gpus-per-node", "8",
                                  "--colocate", "--rollout-num-gpus-per-engine", "64", "run.ray_num_cpus=256"])
    cfg, plan = resolve(load_config(args.config, overrides, args.flags, args.slime))
    assert (cfg.cluster.engine_tensor_parallel_size, cfg.rollout.num_engines, plan.engine_nodes) == (64, 2, 8)
    assert [[r.node for r in e.node_ranks] for e in plan.engines] == [list(range(8)), list(range(8, 16))]
    assert plan.engines[1].node_ranks[7].command[-5:-2] == ["8", "--node-rank", "7"]


def test_a_teacher_engine_within_a_node_keeps_any_tp_whose_bundles_fit_one():
    _, plan = resolve(load_config("examples/configs/distill.yaml", ["cluster.gpus_per_node=8",
                                                                   "teacher.tensor_parallel_size=3"]))
    assert plan.side_fleet("teacher").nodes == 1 and plan.side_fleet("teacher").engines[0].bundles == [3, 4, 5]


def test_a_grant_that_puts_a_node_ranks_gpus_on_two_nodes_is_refused_before_any_engine_starts():
    from launch.run.cluster import ClusterError, Placement
    from launch.run.fleets import check_whole_nodes

    _, plan = resolve(load_config(DEMO, SPANNING))
    n = len(plan.bundles)
    whole = Placement(group=None, ray_bundle=list(range(n)), node_ip=[f"10.0.0.{b // 8}" for b in range(n)],
                      gpu_id=[b % 8 for b in range(n)])
    check_whole_nodes(whole, plan.engines)
    # the driver's node held one bundle and sorted first: every node rank's GPUs straddle two nodes
    shifted = Placement(group=None, ray_bundle=list(range(n)), node_ip=["10.0.0.9", *whole.node_ip[:-1]],
                        gpu_id=whole.gpu_id)
    with pytest.raises(ClusterError, match=r"^engine 0 node rank 0's bundles 0-7 were granted on 10\.0\.0\.0, "
                                           r"10\.0\.0\.9, not on a node of their own: an engine that spans nodes "
                                           r"needs whole nodes"):
        check_whole_nodes(shifted, plan.engines)
    one_node = Placement(group=None, ray_bundle=list(range(n)), node_ip=["10.0.0.0"] * n, gpu_id=whole.gpu_id)
    with pytest.raises(ClusterError, match=r"^engine 0 node rank 0's bundles 0-7 were granted on 10\.0\.0\.0, not on "
                                           r"a node of their own"):
        check_whole_nodes(one_node, plan.engines)  # two node ranks of one engine on one node
