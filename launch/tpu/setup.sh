#!/usr/bin/env bash
# Sets up every worker of every node: the code at COMMIT (cloned from REPO_URL, or, without one, a
# `git archive` of this checkout copied over), a Python 3.11 virtual environment with the pinned
# requirements, and the pinned TPU jax build (JAX_TPU).
#
#   bash launch/tpu/setup.sh --env FILE [--dry-run]
set -euo pipefail
# shellcheck source=launch/tpu/lib.sh
source "$(dirname "$0")/lib.sh"
parse_args "$0" "$@"

install="cd $REMOTE_DIR && $PYTHON -m venv .venv && .venv/bin/pip install -q -r requirements.txt"
install+=" && .venv/bin/pip install -q '$JAX_TPU' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html"
mapfile -t nodes < <(learner_nodes; rollout_nodes)
if [ -n "$REPO_URL" ]; then
  code="( [ -d $REMOTE_DIR ] || git clone -q $REPO_URL $REMOTE_DIR ) && git -C $REMOTE_DIR fetch -q && git -C $REMOTE_DIR checkout -q $COMMIT"
else
  archive="/tmp/$NAME-code.tar.gz"
  run git -C "$(dirname "$0")/../.." archive --format=tar.gz -o "$archive" "$COMMIT"
  for node in "${nodes[@]}"; do
    run gcloud compute tpus tpu-vm scp "$archive" "$node:~/code.tar.gz" --project="$PROJECT" --zone="$ZONE" --worker=all
  done
  code="mkdir -p $REMOTE_DIR && tar -xzf ~/code.tar.gz -C $REMOTE_DIR"
fi
for node in "${nodes[@]}"; do
  ssh_worker "$node" all "set -e; $code && $install"
done
echo "[setup] done; next: launch/tpu/start.sh --env $ENV_FILE"
