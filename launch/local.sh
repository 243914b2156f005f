#!/usr/bin/env bash
# Multi-process topology on one machine: K decode-server processes + one learner process, talking gRPC
# (trajectories, control) and jax.experimental.transfer (weights) on 127.0.0.1.
#
#   bash launch/local.sh WORKDIR [K] [--config.x=y ...]
#
# Each decode server gets ASYNCRL_SERVER_DEVICES virtual CPU devices (default 1) and the learner
# ASYNCRL_LEARNER_DEVICES (default 1). Logs: WORKDIR/servers/decode-*.log. Servers stop when the
# learner exits (or on Ctrl-C).
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR="${1:?usage: launch/local.sh WORKDIR [K] [--config.x=y ...]}"
K="${2:-2}"
shift $(( $# >= 2 ? 2 : 1 ))
CONFIG="${ASYNCRL_CONFIG:-configs/default.py}"
PY="${PYTHON:-.venv/bin/python}"
SERVER_DEVICES="${ASYNCRL_SERVER_DEVICES:-1}"
LEARNER_DEVICES="${ASYNCRL_LEARNER_DEVICES:-1}"

mkdir -p "$WORKDIR/servers"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

for i in $(seq 0 $((K - 1))); do
  rm -f "$WORKDIR/servers/port-$i"
  XLA_FLAGS="--xla_force_host_platform_device_count=$SERVER_DEVICES" ASYNCRL_CPU_DEVICES="$SERVER_DEVICES" \
    "$PY" -m asyncrl_jax.rollout.main --config="$CONFIG" --server_id="decode-$i" \
    --port_file="$WORKDIR/servers/port-$i" "$@" > "$WORKDIR/servers/decode-$i.log" 2>&1 &
  pids+=($!)
done

addresses=()
for i in $(seq 0 $((K - 1))); do
  for _ in $(seq 1 600); do
    [ -f "$WORKDIR/servers/port-$i" ] && break
    kill -0 "${pids[$i]}" 2>/dev/null || { echo "decode server $i died:"; tail -20 "$WORKDIR/servers/decode-$i.log"; exit 1; }
    sleep 0.2
  done
  [ -f "$WORKDIR/servers/port-$i" ] || { echo "decode server $i did not start"; exit 1; }
  addresses+=("127.0.0.1:$(cat "$WORKDIR/servers/port-$i")")
done
joined=$(IFS=,; echo "${addresses[*]}")
echo "[local.sh] decode servers: $joined"

XLA_FLAGS="--xla_force_host_platform_device_count=$LEARNER_DEVICES" \
  "$PY" -m asyncrl_jax.train --config="$CONFIG" --workdir="$WORKDIR" \
  --config.rollout.addresses="$joined" "$@"
