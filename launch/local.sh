#!/usr/bin/env bash
# The pod's twin on one machine: P learner processes (jax.distributed on 127.0.0.1) and K decode-server
# processes, started with the same entry points and flags that the TPU launch starts on a pod; only
# the addresses differ.
#
#   bash launch/local.sh WORKDIR --learners P --servers K [--learner-devices N] [--server-devices M]
#                        [--no-watch] [--config.x=y ...]
#
# N and M count virtual CPU devices per process (default 1 and 1). Learner process 0 prints the run;
# the others log to WORKDIR/learners/learner-I.log, decode servers to WORKDIR/servers/decode-I.log.
# Decode servers register with learner process 0 (its registry address appears in
# WORKDIR/registry_address; pids in WORKDIR/learners/pid-I and WORKDIR/servers/pid-I). Every process
# is stopped on exit, on error and on Ctrl-C; the exit code is learner process 0's (or 1 if another
# learner process failed first; with --no-watch that is left to the learner itself, which stops every
# process within ASYNCRL_HEARTBEAT_SECONDS). A decode server that dies does not stop the run: the
# learner goes on without it, and a server started again with the same --server_id rejoins.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}
[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage 0 ;; esac
WORKDIR="$1"; shift
P=1; K=1; N=1; M=1; WATCH=1; overrides=()
while [ $# -gt 0 ]; do
  case "$1" in
    --learners) P="${2:?--learners needs a number}"; shift 2 ;;
    --servers) K="${2:?--servers needs a number}"; shift 2 ;;
    --learner-devices) N="${2:?--learner-devices needs a number}"; shift 2 ;;
    --server-devices) M="${2:?--server-devices needs a number}"; shift 2 ;;
    --no-watch) WATCH=0; shift ;;
    --config.*|--config=*) overrides+=("$1"); shift ;;
    -h|--help) usage 0 ;;
    [0-9]*) echo "local.sh: 'local.sh WORKDIR K' is replaced by 'local.sh WORKDIR --learners P --servers K'" >&2; exit 2 ;;
    *) echo "local.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
for v in "$P" "$K" "$N" "$M"; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "local.sh: counts must be positive integers, got '$v'" >&2; exit 2; }
done
CONFIG="${ASYNCRL_CONFIG:-configs/default.py}"
PY="${PYTHON:-.venv/bin/python}"

mkdir -p "$WORKDIR/learners" "$WORKDIR/servers"
rm -f "$WORKDIR/registry_address" "$WORKDIR"/learners/pid-* "$WORKDIR"/servers/pid-*
pids=(); names=()
# shellcheck disable=SC2329  # called by the EXIT trap
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'echo "[local.sh] interrupted; stopping every process" >&2; exit 130' INT TERM

coordinator="127.0.0.1:$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
for i in $(seq 0 $((P - 1))); do
  env=(XLA_FLAGS="--xla_force_host_platform_device_count=$N" ASYNCRL_CPU_DEVICES="$N")
  if [ "$P" -gt 1 ]; then
    env+=(ASYNCRL_COORDINATOR="$coordinator" ASYNCRL_NUM_PROCESSES="$P" ASYNCRL_PROCESS_ID="$i")
  fi
  cmd=("$PY" -m asyncrl_jax.train --config="$CONFIG" --workdir="$WORKDIR" --config.rollout.servers="$K"
       "${overrides[@]}")
  if [ "$i" -eq 0 ]; then
    env "${env[@]}" "${cmd[@]}" &
  else
    env "${env[@]}" "${cmd[@]}" > "$WORKDIR/learners/learner-$i.log" 2>&1 &
  fi
  pids+=($!); names+=("learner process $i")
  echo "$!" > "$WORKDIR/learners/pid-$i"
done
echo "[local.sh] $P learner process(es), coordinator $coordinator; waiting for the registry"

for _ in $(seq 1 3000); do
  [ -f "$WORKDIR/registry_address" ] && break
  if ! kill -0 "${pids[0]}" 2>/dev/null; then
    if wait "${pids[0]}"; then rc=0; else rc=$?; fi
    echo "[local.sh] learner process 0 exited ($rc) before its registry came up" >&2
    exit $(( rc == 0 ? 1 : rc ))
  fi
  sleep 0.2
done
[ -f "$WORKDIR/registry_address" ] || { echo "[local.sh] no registry address after 600 s" >&2; exit 1; }
registry="$(cat "$WORKDIR/registry_address")"

for i in $(seq 0 $((K - 1))); do
  XLA_FLAGS="--xla_force_host_platform_device_count=$M" ASYNCRL_CPU_DEVICES="$M" \
    "$PY" -m asyncrl_jax.rollout.main --config="$CONFIG" --server_id="decode-$i" \
    --port_file="$WORKDIR/servers/port-$i" --config.rollout.learner_address="$registry" \
    "${overrides[@]}" > "$WORKDIR/servers/decode-$i.log" 2>&1 &
  pids+=($!); names+=("decode server $i")
  echo "$!" > "$WORKDIR/servers/pid-$i"
done
echo "[local.sh] $K decode server(s) registering at $registry"

# Learner process 0's exit code is the run's; any other process failing first stops everything.
declare -A reaped=()
while kill -0 "${pids[0]}" 2>/dev/null; do
  for j in $(seq 1 $((${#pids[@]} - 1))); do
    if [ -z "${reaped[$j]:-}" ] && ! kill -0 "${pids[$j]}" 2>/dev/null; then
      reaped[$j]=1
      if wait "${pids[$j]}"; then rc=0; else rc=$?; fi
      if [ "$rc" -ne 0 ] && [ "$j" -ge "$P" ]; then
        # the learner drops a dead decode server and goes on with the others (docs/failure-modes.md)
        echo "[local.sh] ${names[$j]} exited ($rc); the learner goes on without it" >&2
      elif [ "$rc" -ne 0 ] && [ "$WATCH" -eq 1 ]; then
        log="$WORKDIR/learners/learner-$j.log"
        echo "[local.sh] ${names[$j]} failed (exit $rc); last lines of $log:" >&2
        tail -20 "$log" >&2
        exit 1
      fi
    fi
  done
  sleep 0.5
done
if wait "${pids[0]}"; then rc=0; else rc=$?; fi
exit "$rc"
