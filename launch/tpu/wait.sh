#!/usr/bin/env bash
# Waits until both queued resources are ACTIVE (checks every 30 s, gives up after WAIT_MINUTES,
# default 120; exits 1 if one FAILED or was SUSPENDED).
#
#   bash launch/tpu/wait.sh --env FILE [--dry-run]
set -euo pipefail
# shellcheck source=launch/tpu/lib.sh
source "$(dirname "$0")/lib.sh"
parse_args "$0" "$@"

deadline=$(( $(date +%s) + ${WAIT_MINUTES:-120} * 60 ))
for qr in "$NAME-learner-qr" "$NAME-rollout-qr"; do
  while true; do
    state="$(gcloud_tpu queued-resources describe "$qr" --format='value(state.state)')"
    if [ "$DRY_RUN" -eq 1 ]; then break; fi
    echo "[wait] $qr: $state"
    case "$state" in
      ACTIVE) break ;;
      FAILED|SUSPENDED) echo "[wait] $qr is $state; see: gcloud compute tpus queued-resources describe $qr" >&2; exit 1 ;;
    esac
    [ "$(date +%s)" -lt "$deadline" ] || { echo "[wait] $qr not ACTIVE after ${WAIT_MINUTES:-120} min" >&2; exit 1; }
    sleep 30
  done
done
