#!/usr/bin/env bash
# Creates the learner slice(s) and the decode-server hosts as Cloud TPU queued resources.
#
#   bash launch/tpu/create.sh --env FILE [--dry-run]
#
# The learner: LEARNER_SLICES slices of LEARNER_ACCELERATOR (more than one: a multislice learner,
# --node-count). The decode servers: ROLLOUT_SERVERS single-host TPU VMs of ROLLOUT_ACCELERATOR.
# PROVISIONING is spot, reserved or on-demand. The runtime version follows the accelerator type
# unless RUNTIME_VERSION says otherwise. Then: wait.sh, setup.sh, start.sh.
set -euo pipefail
# shellcheck source=launch/tpu/lib.sh
source "$(dirname "$0")/lib.sh"
parse_args "$0" "$@"

provisioning=()
case "$PROVISIONING" in
  spot) provisioning=(--spot) ;;
  reserved) provisioning=(--reserved) ;;
esac

nodes() {  # nodes PREFIX COUNT: --node-id for one, --node-count/--node-prefix for several
  if [ "$2" -eq 1 ]; then echo "--node-id=$1"; else echo "--node-count=$2"; echo "--node-prefix=$1"; fi
}

mapfile -t learner_nodes < <(nodes "$NAME-learner" "$LEARNER_SLICES")
mapfile -t rollout_nodes < <(nodes "$NAME-rollout" "$ROLLOUT_SERVERS")
gcloud_tpu queued-resources create "$NAME-learner-qr" --accelerator-type="$LEARNER_ACCELERATOR" \
  --runtime-version="$RUNTIME_VERSION" "${learner_nodes[@]}" "${provisioning[@]}"
gcloud_tpu queued-resources create "$NAME-rollout-qr" --accelerator-type="$ROLLOUT_ACCELERATOR" \
  --runtime-version="$ROLLOUT_RUNTIME_VERSION" "${rollout_nodes[@]}" "${provisioning[@]}"
echo "[create] requested $NAME-learner-qr and $NAME-rollout-qr; next: launch/tpu/wait.sh --env $ENV_FILE"
