#!/usr/bin/env bash
# One machine: sluice starts its own local Ray cluster, the engines, the router and the trainer.
#
#   launch/scripts/single_node.sh [sluice args...]          e.g.  --dry-run   or   run.num_steps=5
#
# CONFIG picks the run config (default: the CPU demo; CONFIG="" none: the arguments say everything, as a slime-style
# script's do). Every other argument goes to sluice unchanged (slime's launch arguments among them):
# config overrides (section.key=value), megatron-core flags (--tensor-model-parallel-size 2 ...),
# SGLang server options (--sglang-<option>) and sgl-router options (--router-<option>).
set -euo pipefail
cd "$(dirname "$0")/../.."                      # repository root, so relative config paths work

CONFIG=${CONFIG-examples/configs/demo.yaml}
source launch/scripts/common.bash
SLUICE=${SLUICE:-$(find_tool sluice)}            # PATH, else .venv/bin/sluice

# A local Ray cluster for one user: no token auth. Tokenizers must not fork thread pools into engine processes.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export TOKENIZERS_PARALLELISM=false

exec "$SLUICE" ${CONFIG:+--config "$CONFIG"} "$@"
