#!/usr/bin/env bash
# Several nodes: one Ray cluster across them (`ray start` on every node), then sluice on the head node attaches
# to it (run.ray_address=auto) and places trainer ranks and engines with one placement group.
#
# On the head node (it runs the driver and the router; engines start on their bundles' nodes):
#   ROLE=head   NUM_NODES=2 launch/scripts/multi_node.sh [sluice args...]
# On every other node, once the head is up:
#   ROLE=worker HEAD_IP=10.0.0.1 launch/scripts/multi_node.sh
# Check the plan without starting anything (any node, no Ray needed):
#   launch/scripts/multi_node.sh --dry-run
set -euo pipefail
cd "$(dirname "$0")/../.."

CONFIG=${CONFIG:-examples/configs/qwen3_30b_a3b.yaml}
SLUICE=${SLUICE:-sluice}
ROLE=${ROLE:-head}
RAY_PORT=${RAY_PORT:-6379}
NUM_NODES=${NUM_NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NODE_WAIT_S=${NODE_WAIT_S:-600}   # how long the head waits for the workers, and a worker for the head

# NCCL over the cluster network; set NCCL_SOCKET_IFNAME / NCCL_IB_HCA to your fabric if auto-detection picks wrong.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TOKENIZERS_PARALLELISM=false

if [[ " $* " == *" --dry-run "* ]]; then       # validation only: no Ray, no processes
  exec "$SLUICE" --config "$CONFIG" cluster.num_nodes="$NUM_NODES" cluster.gpus_per_node="$GPUS_PER_NODE" "$@"
fi

if [[ "$ROLE" == worker ]]; then
  : "${HEAD_IP:?set HEAD_IP to the address of the head node}"
  deadline=$((SECONDS + NODE_WAIT_S))
  until (exec 3<>"/dev/tcp/$HEAD_IP/$RAY_PORT") 2>/dev/null; do   # ray start alone would retry forever
    if (( SECONDS >= deadline )); then
      echo "sluice: no Ray head answered at $HEAD_IP:$RAY_PORT within ${NODE_WAIT_S}s; check HEAD_IP and RAY_PORT, and start the head first" >&2
      exit 1
    fi
    sleep 2
  done
  exec ray start --address="$HEAD_IP:$RAY_PORT" --num-gpus="$GPUS_PER_NODE" --block
fi

# The config is checked before anything starts: a bad key fails here in seconds, not after Ray is up.
"$SLUICE" --config "$CONFIG" cluster.num_nodes="$NUM_NODES" cluster.gpus_per_node="$GPUS_PER_NODE" "$@" --dry-run >/dev/null

ray start --head --port="$RAY_PORT" --num-gpus="$GPUS_PER_NODE" --disable-usage-stats
trap 'ray stop' EXIT
# Wait until every node has joined: the placement group spans NUM_NODES x GPUS_PER_NODE GPUs.
deadline=$((SECONDS + NODE_WAIT_S))
while :; do
  joined=$(ray status 2>/dev/null | grep -c 'node_' || true)
  (( joined >= NUM_NODES )) && break
  if (( SECONDS >= deadline )); then
    echo "sluice: only $joined/$NUM_NODES nodes joined within ${NODE_WAIT_S}s; start the others with ROLE=worker HEAD_IP=<this node's address> $0" >&2
    exit 1
  fi
  echo "sluice: $joined/$NUM_NODES nodes joined; waiting up to ${NODE_WAIT_S}s" >&2
  sleep 5
done

"$SLUICE" --config "$CONFIG" run.ray_address=auto cluster.num_nodes="$NUM_NODES" \
  cluster.gpus_per_node="$GPUS_PER_NODE" "$@"
