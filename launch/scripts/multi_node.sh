#!/usr/bin/env bash
# Several nodes: one Ray cluster across them (`ray start` on every node), then sluice on the head node attaches
# to it and places trainer ranks and engines with one placement group.
#
# On the head node (it runs the driver and the router; engines and trainer ranks start on their bundles' nodes):
#   ROLE=head   NUM_NODES=2 launch/scripts/multi_node.sh [sluice args...]
# On every other node, once the head is up:
#   ROLE=worker HEAD_IP=10.0.0.1 launch/scripts/multi_node.sh
# Check the plan without starting anything (any node, no Ray needed):
#   launch/scripts/multi_node.sh --dry-run
#
# Every node must see the model directory (model.path, or runs/<name>/init_model written by the head) at the same
# absolute path: a shared file system. sluice checks it on every node before any engine starts.
# Waits: a worker waits NODE_WAIT_S for the head's port; the head waits NODE_WAIT_S for NUM_NODES nodes to join.
# Ray on this node is stopped by the pid this script started it with (never `ray stop`, which ends every Ray here).
set -euo pipefail
cd "$(dirname "$0")/../.."

CONFIG=${CONFIG-examples/configs/qwen3_30b_a3b.yaml}   # CONFIG="": none (a slime-style script's arguments)
source launch/scripts/common.bash
SLUICE=${SLUICE:-$(find_tool sluice)}            # PATH, else .venv/bin/sluice
ROLE=${ROLE:-head}
RAY_PORT=${RAY_PORT:-6379}
NUM_NODES=${NUM_NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}   # 0: CPU bundles (Ray spreads them over the nodes)
NODE_WAIT_S=${NODE_WAIT_S:-600}     # how long the head waits for the workers, and a worker for the head
NODE_IP=${NODE_IP:-}                # this node's address in Ray (several networks); empty: Ray's pick
NUM_CPUS=${NUM_CPUS:-}              # CPUs this node offers Ray; empty: all of them

# NCCL over the cluster network; set NCCL_SOCKET_IFNAME / NCCL_IB_HCA to your fabric if auto-detection picks wrong.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TOKENIZERS_PARALLELISM=false

cluster=(cluster.num_nodes="$NUM_NODES" cluster.gpus_per_node="$GPUS_PER_NODE" cluster.node_wait_s="$NODE_WAIT_S")
[[ -n "$NODE_IP" ]] && cluster+=(cluster.node_ip="$NODE_IP")
if [[ " $* " == *" --dry-run "* ]]; then       # validation only: no Ray, no processes
  exec "$SLUICE" ${CONFIG:+--config "$CONFIG"} "${cluster[@]}" "$@"
fi

RAY=${RAY:-$(find_tool ray)}
node=(--num-gpus="$GPUS_PER_NODE")
[[ -n "$NODE_IP" ]] && node+=(--node-ip-address="$NODE_IP")
[[ -n "$NUM_CPUS" ]] && node+=(--num-cpus="$NUM_CPUS")

wait_for_port() {  # host port problem hint: until something listens there, at most NODE_WAIT_S
  local deadline=$((SECONDS + NODE_WAIT_S))
  until (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; do
    if (( SECONDS >= deadline )); then
      echo "sluice: $3 at $1:$2 within ${NODE_WAIT_S}s; $4" >&2
      exit 1
    fi
    [[ -z "${ray_pid:-}" ]] || kill -0 "$ray_pid" 2>/dev/null || { echo "sluice: ray start --head exited" >&2; exit 1; }
    sleep 1
  done
}

if [[ "$ROLE" == worker ]]; then
  : "${HEAD_IP:?set HEAD_IP to the address of the head node}"
  wait_for_port "$HEAD_IP" "$RAY_PORT" "no Ray head answered" \
    "check HEAD_IP and RAY_PORT, and start the head first"   # ray start alone would retry forever
  exec "$RAY" start --address="$HEAD_IP:$RAY_PORT" "${node[@]}" --block
fi

# The config is checked before anything starts: a bad key fails here in seconds, not after Ray is up.
"$SLUICE" ${CONFIG:+--config "$CONFIG"} "${cluster[@]}" "$@" --dry-run >/dev/null

"$RAY" start --head --port="$RAY_PORT" "${node[@]}" --disable-usage-stats --include-dashboard=false --block &
ray_pid=$!
stop_ray() { kill -TERM "$ray_pid" 2>/dev/null && wait "$ray_pid" 2>/dev/null || true; }
trap stop_ray EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
HEAD=${NODE_IP:-127.0.0.1}
wait_for_port "$HEAD" "$RAY_PORT" "the Ray head did not come up" "see the ray start output above"
# sluice waits for NUM_NODES nodes (cluster.node_wait_s), saying which have joined, then runs.
"$SLUICE" ${CONFIG:+--config "$CONFIG"} run.ray_address="$HEAD:$RAY_PORT" "${cluster[@]}" "$@"
