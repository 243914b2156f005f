#!/usr/bin/env bash
# Stops every learner and decode-server process (SIGTERM, then SIGKILL after 30 s). The slices stay;
# start.sh resumes from the last checkpoint in WORKDIR.
#
#   bash launch/tpu/stop.sh --env FILE [--dry-run]
set -euo pipefail
# shellcheck source=launch/tpu/lib.sh
source "$(dirname "$0")/lib.sh"
parse_args "$0" "$@"

stop="pkill -TERM -f 'asyncrl_jax\.(train|rollout\.main)'; sleep 30; pkill -KILL -f 'asyncrl_jax\.(train|rollout\.main)' || true"
mapfile -t nodes < <(learner_nodes; rollout_nodes)
for node in "${nodes[@]}"; do
  ssh_worker "$node" all "$stop"
done
