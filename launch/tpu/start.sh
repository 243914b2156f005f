#!/usr/bin/env bash
# Starts the learner processes on every learner worker and a decode server on every rollout host,
# wired to each other: learner worker i of slice s is process s * HOSTS + i of LEARNER_SLICES * HOSTS,
# with learner worker 0 of slice 0 as the jax.distributed coordinator (COORDINATOR_PORT) and the
# decode servers' registry (REGISTRY_PORT). Each process logs to ~/asyncrl_*.log on its host; the run's
# records go to WORKDIR.
#
#   bash launch/tpu/start.sh --env FILE [--dry-run]
set -euo pipefail
# shellcheck source=launch/tpu/lib.sh
source "$(dirname "$0")/lib.sh"
parse_args "$0" "$@"

hosts="$(hosts_of "$LEARNER_ACCELERATOR")"
processes=$((LEARNER_SLICES * hosts))
mapfile -t lnodes < <(learner_nodes)
mapfile -t coordinator_ips < <(worker_ips "${lnodes[0]}" "$LEARNER_ACCELERATOR")
coordinator="${coordinator_ips[0]}"
# shellcheck disable=SC2153  # OVERRIDES comes from the env file (lib.sh)
read -r -a overrides <<< "$OVERRIDES"

for s in "${!lnodes[@]}"; do
  mapfile -t ips < <(worker_ips "${lnodes[$s]}" "$LEARNER_ACCELERATOR")
  for i in $(seq 0 $((hosts - 1))); do
    pid=$((s * hosts + i))
    env="ASYNCRL_COORDINATOR=$coordinator:$COORDINATOR_PORT ASYNCRL_NUM_PROCESSES=$processes ASYNCRL_PROCESS_ID=$pid"
    if [ "$LEARNER_SLICES" -gt 1 ]; then
      env+=" MEGASCALE_COORDINATOR_ADDRESS=$coordinator MEGASCALE_NUM_SLICES=$LEARNER_SLICES MEGASCALE_SLICE_ID=$s"
    fi
    cmd="cd $REMOTE_DIR && $env nohup .venv/bin/python -m asyncrl_jax.train --config=$CONFIG --workdir=$WORKDIR"
    cmd+=" --config.rollout.servers=$ROLLOUT_SERVERS --config.rollout.host=${ips[$i]}"
    cmd+=" --config.rollout.registry_port=$REGISTRY_PORT ${overrides[*]} > ~/asyncrl_learner.log 2>&1 &"
    ssh_worker "${lnodes[$s]}" "$i" "$cmd"
  done
done

mapfile -t rnodes < <(rollout_nodes)
for j in "${!rnodes[@]}"; do
  mapfile -t ips < <(worker_ips "${rnodes[$j]}" "$ROLLOUT_ACCELERATOR")
  cmd="cd $REMOTE_DIR && nohup .venv/bin/python -m asyncrl_jax.rollout.main --config=$CONFIG --server_id=decode-$j"
  cmd+=" --config.rollout.host=${ips[0]} --config.rollout.port=$ROLLOUT_PORT"
  cmd+=" --config.rollout.learner_address=$coordinator:$REGISTRY_PORT ${overrides[*]} > ~/asyncrl_decode.log 2>&1 &"
  ssh_worker "${rnodes[$j]}" 0 "$cmd"
done
echo "[start] $processes learner processes, $ROLLOUT_SERVERS decode servers; watch: launch/tpu/status.sh --env $ENV_FILE"
