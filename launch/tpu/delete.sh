#!/usr/bin/env bash
# Deletes both queued resources and their TPU VMs (everything on their disks is lost; WORKDIR in
# gs:// stays). Asks first; --yes skips the question, and without a terminal --yes is required
# (--dry-run, which changes nothing, needs neither).
#
#   bash launch/tpu/delete.sh --env FILE [--yes] [--dry-run]
set -euo pipefail
# shellcheck source=launch/tpu/lib.sh
source "$(dirname "$0")/lib.sh"
parse_args "$0" "$@"

confirm "delete $NAME-learner-qr and $NAME-rollout-qr in $PROJECT/$ZONE?" || { echo "[delete] not deleted"; exit 1; }
for qr in "$NAME-learner-qr" "$NAME-rollout-qr"; do
  gcloud_tpu queued-resources delete "$qr" --force --quiet --async
done
