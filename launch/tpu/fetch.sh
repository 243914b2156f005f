#!/usr/bin/env bash
# Copies the run's records from WORKDIR (metrics.jsonl, trained_prompts.jsonl, summary.json,
# progress.png, config.json, TensorBoard events) to runs/NAME/ here; with CHECKPOINTS=1 the
# checkpoints too.
#
#   bash launch/tpu/fetch.sh --env FILE [--dry-run]
set -euo pipefail
# shellcheck source=launch/tpu/lib.sh
source "$(dirname "$0")/lib.sh"
parse_args "$0" "$@"

dest="runs/$NAME"
run mkdir -p "$dest"
for f in metrics.jsonl trained_prompts.jsonl summary.json progress.png config.json; do
  run gcloud storage cp "$WORKDIR/$f" "$dest/" || echo "[fetch] $WORKDIR/$f not there (yet)"
done
run gcloud storage cp -r "$WORKDIR/tb" "$dest/"
if [ "${CHECKPOINTS:-0}" = 1 ]; then
  run gcloud storage cp -r "$WORKDIR/checkpoints" "$dest/"
fi
