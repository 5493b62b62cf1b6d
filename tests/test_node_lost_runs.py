"""A whole run on a cluster of three raylets started here (each on its own loopback address, stopped by pid) loses
the node that holds two of its engines, and no node has room for them: the engines' hosts give up after
cluster.placement_timeout_s, the run finishes the step in progress, writes its checkpoint (its trainer rank is on
another node, whole) and ends with one line naming what is missing and the checkpoint. `make soak` covers a node
that comes back (its engines and trainer rank healed in the run); tests/test_node_lost.py the same parts with
doubles, in `make test`."""
import time

import pytest

from conftest import free_port
from glue.loop.checkpoint import Checkpoints
from helpers.ray_nodes import RayNode
from helpers.run_session import Session, logged_steps, wait_until

pytestmark = pytest.mark.long  # three raylets, three engines and a trainer on two cores: 2-4 minutes

HEAD_IP, LOST_IP, KEPT_IP = "127.0.0.21", "127.0.0.22", "127.0.0.23"


def test_a_node_lost_with_no_room_left_for_its_engines_stops_the_run_with_its_checkpoint_and_one_line(tmp_path):
    import sys

    port = free_port()
    head = RayNode(num_cpus=1, port=port, node_ip=HEAD_IP)
    nodes = [head]
    session = None
    try:
        head.up()
        # bundles go to the driver's node first, then by node address: engine 0 on the head, engines 1 and 2 on the
        # node that is lost, the trainer rank (the last bundle) on the node that stays
        nodes.append(RayNode(num_cpus=2, head=f"{HEAD_IP}:{port}", node_ip=LOST_IP).up())
        nodes.append(RayNode(num_cpus=1, head=f"{HEAD_IP}:{port}", node_ip=KEPT_IP).up())
        run_dir = tmp_path / "lost"
        session = Session([sys.executable, "-m", "launch", "--config", "examples/configs/demo.yaml",
                           f"run.output_dir={tmp_path}", "run.name=lost", "run.num_steps=30", "run.mode=async",
                           "run.save_interval=2", "rollout.num_engines=3", "rollout.prompts_per_step=4",
                           "rollout.health_check_interval_s=1", "rollout.health_check_timeout_s=3",
                           "cluster.num_nodes=3", f"cluster.node_ip={HEAD_IP}", f"run.ray_address={HEAD_IP}:{port}",
                           "cluster.placement_timeout_s=20"], tmp_path / "run.log")
        wait_until(lambda: logged_steps(run_dir) >= 3, session, 600, "step 3")
        placement = next(line for line in session.lines if "sluice: placement" in line)
        assert f"{LOST_IP}: engine 1, engine 2" in placement and f"{KEPT_IP}: trainer rank 0" in placement, placement
        lost_at = time.monotonic()
        nodes[1].die()  # the node's raylet and everything in its session, at once; nothing comes back
        code = session.wait(600)
        took = time.monotonic() - lost_at
    finally:
        if session is not None and session.proc.poll() is None:
            session.kill()
        for node in reversed(nodes):
            node.stop()
    lines = "\n".join(session.lines)
    assert code == 1, lines[-3000:]
    error = next(line for line in session.lines if line.startswith("sluice: error: "))
    latest = Checkpoints(run_dir / "checkpoints").latest()
    step = Checkpoints.read_state(latest)["step"]
    assert " did not start on its placement-group bundle within 20 s (is its node gone, with no other node that " \
           "has room for it?)" in error, error
    assert error.startswith("sluice: error: engine 1 (") or error.startswith("sluice: error: engine 2 ("), error
    assert f"; the run stopped at step {step} of 30 with its checkpoint {latest}. " in error, error
    assert step >= 3 and logged_steps(run_dir) == step  # the steps trained after the loss are in the checkpoint
    assert "stopping after the step in progress, with its checkpoint" in lines
    print(f"node lost at step >= 3; the run stopped at step {step} with its checkpoint, {took:.0f} s after the loss")
