#!/usr/bin/env bash
# Prints every process's log: learner processes (~/asyncrl_learner.log) and decode servers
# (~/asyncrl_decode.log), LINES lines each (default 100).
#
#   bash launch/tpu/logs.sh --env FILE [--dry-run]
set -euo pipefail
# shellcheck source=launch/tpu/lib.sh
source "$(dirname "$0")/lib.sh"
parse_args "$0" "$@"

lines="${LINES:-100}"
mapfile -t lnodes < <(learner_nodes)
for node in "${lnodes[@]}"; do
  ssh_worker "$node" all "echo == \$(hostname); tail -n $lines ~/asyncrl_learner.log"
done
mapfile -t rnodes < <(rollout_nodes)
for node in "${rnodes[@]}"; do
  ssh_worker "$node" 0 "echo == \$(hostname); tail -n $lines ~/asyncrl_decode.log"
done
