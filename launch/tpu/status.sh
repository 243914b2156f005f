#!/usr/bin/env bash
# The queued resources' state, whether each learner and decode-server process is up, and the last
# lines of learner process 0's log (its progress bar: versions, reward, staleness, tokens/s).
#
#   bash launch/tpu/status.sh --env FILE [--dry-run]
set -euo pipefail
# shellcheck source=launch/tpu/lib.sh
source "$(dirname "$0")/lib.sh"
parse_args "$0" "$@"

for qr in "$NAME-learner-qr" "$NAME-rollout-qr"; do
  gcloud_tpu queued-resources describe "$qr" --format='value(name,state.state)'
done
mapfile -t nodes < <(learner_nodes; rollout_nodes)
for node in "${nodes[@]}"; do
  ssh_worker "$node" all "pgrep -af 'asyncrl_jax\.(train|rollout\.main)' || echo 'no asyncrl process on' \$(hostname)"
done
mapfile -t lnodes < <(learner_nodes)
ssh_worker "${lnodes[0]}" 0 "tail -n 20 ~/asyncrl_learner.log"
