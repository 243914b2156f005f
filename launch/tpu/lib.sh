#!/usr/bin/env bash
# Shared by the Cloud TPU scripts in launch/tpu/ (sourced, not run). Every script:
#   SCRIPT --env FILE [--dry-run] [--yes] [--help]
# --dry-run prints every command it would run (one per line, prefixed "+ ") and changes nothing; it
# needs no gcloud. Settings come from the env file (KEY=VALUE lines; see launch/tpu/examples/).

# The fields an env file may set, with their defaults ("" = required).
declare -A ASYNCRL_DEFAULTS=(
  [PROJECT]="" [ZONE]="" [NAME]=""
  [LEARNER_ACCELERATOR]="" [LEARNER_SLICES]="1"
  [ROLLOUT_ACCELERATOR]="" [ROLLOUT_SERVERS]="1"
  [PROVISIONING]="spot" [RUNTIME_VERSION]=""
  [CONFIG]="configs/default.py" [OVERRIDES]=""
  [WORKDIR]="" [REPO_URL]="" [COMMIT]="main"
  [JAX_TPU]="jax[tpu]==0.10.2" [PYTHON]="python3.11"
  [COORDINATOR_PORT]="8476" [REGISTRY_PORT]="8477" [ROLLOUT_PORT]="8478"
  [REMOTE_DIR]="asyncrl_jax"
  [IMAGE]=""  # the container image, for GKE only (python -m asyncrl_jax.tools.gke)
)

DRY_RUN=0
ASSUME_YES=0
ENV_FILE=""

die() { echo "error: $*" >&2; exit 2; }

usage_from() {  # prints the leading comment block of the calling script
  sed -n '2,/^[^#]/p' "$1" | sed '$d' | sed 's/^# \{0,1\}//'
}

parse_args() {  # parse_args SCRIPT "$@"
  local script="$1"; shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --env) ENV_FILE="${2:-}"; [ -n "$ENV_FILE" ] || die "--env needs a file"; shift 2 ;;
      --env=*) ENV_FILE="${1#--env=}"; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      --yes) ASSUME_YES=1; shift ;;
      -h|--help) usage_from "$script"; exit 0 ;;
      *) die "unknown argument '$1' (see --help)" ;;
    esac
  done
  [ -n "$ENV_FILE" ] || die "--env FILE is required (see launch/tpu/examples/)"
  load_env "$ENV_FILE"
}

load_env() {  # KEY=VALUE lines only; unknown keys and missing required ones are errors
  local file="$1" line key value n=0
  [ -f "$file" ] || die "env file '$file' not found"
  for key in "${!ASYNCRL_DEFAULTS[@]}"; do
    printf -v "$key" '%s' "${ASYNCRL_DEFAULTS[$key]}"
  done
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    line="${line%%#*}"
    line="${line#"${line%%[![:space:]]*}"}"
    line="${line%"${line##*[![:space:]]}"}"
    [ -z "$line" ] && continue
    [[ "$line" =~ ^([A-Z_][A-Z0-9_]*)=(.*)$ ]] || die "$file:$n: not a KEY=VALUE line: '$line'"
    key="${BASH_REMATCH[1]}"
    value="${BASH_REMATCH[2]}"
    [[ -v "ASYNCRL_DEFAULTS[$key]" ]] || die "$file:$n: unknown field '$key' (allowed: $(printf '%s ' "${!ASYNCRL_DEFAULTS[@]}" | tr ' ' '\n' | sort | tr '\n' ' '))"
    if [[ "$value" =~ ^\"(.*)\"$ ]] || [[ "$value" =~ ^\'(.*)\'$ ]]; then
      value="${BASH_REMATCH[1]}"
    fi
    printf -v "$key" '%s' "$value"
  done < "$file"
  local missing=()
  for key in PROJECT ZONE NAME LEARNER_ACCELERATOR ROLLOUT_ACCELERATOR WORKDIR; do
    [ -n "${!key}" ] || missing+=("$key")
  done
  [ ${#missing[@]} -eq 0 ] || die "$file: required fields missing: ${missing[*]}"
  case "$PROVISIONING" in spot|reserved|on-demand) ;; *) die "$file: PROVISIONING='$PROVISIONING' must be spot, reserved or on-demand" ;; esac
  for key in LEARNER_SLICES ROLLOUT_SERVERS COORDINATOR_PORT REGISTRY_PORT ROLLOUT_PORT; do
    [[ "${!key}" =~ ^[1-9][0-9]*$ ]] || die "$file: $key='${!key}' must be a positive integer"
  done
  [ -n "$RUNTIME_VERSION" ] || RUNTIME_VERSION="$(runtime_version "$LEARNER_ACCELERATOR")"
  # shellcheck disable=SC2034  # read by create.sh
  ROLLOUT_RUNTIME_VERSION="$(runtime_version "$ROLLOUT_ACCELERATOR")"
  [ "$(hosts_of "$ROLLOUT_ACCELERATOR")" -eq 1 ] \
    || die "$file: ROLLOUT_ACCELERATOR=$ROLLOUT_ACCELERATOR spans several hosts; each decode server is one host (e.g. v5p-8, v6e-8): set ROLLOUT_SERVERS instead"
  return 0
}

runtime_version() {  # the TPU software version for an accelerator type (Cloud TPU's table)
  case "$1" in
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v5litepod-*) echo "v2-alpha-tpuv5-lite" ;;
    v4-*|v3-*|v2-*) echo "tpu-ubuntu2204-base" ;;
    *) die "unknown accelerator type '$1' (v6e-N, v5p-N, v5litepod-N, v4-N)" ;;
  esac
}

hosts_of() {  # TPU VM hosts (workers) in one slice of an accelerator type
  local kind="${1%-*}" n="${1##*-}"
  [[ "$n" =~ ^[0-9]+$ ]] || die "accelerator type '$1' has no size"
  case "$kind" in
    v6e|v5litepod) if [ "$n" -le 8 ]; then echo 1; else echo $((n / 4)); fi ;;  # n chips, 4 per host
    v5p|v4|v3|v2) if [ "$n" -le 8 ]; then echo 1; else echo $((n / 8)); fi ;;  # n TensorCores, 8 per host
    *) die "unknown accelerator type '$1'" ;;
  esac
}

learner_nodes() {  # node names of the learner slices
  if [ "$LEARNER_SLICES" -eq 1 ]; then echo "$NAME-learner"; return; fi
  local i; for i in $(seq 0 $((LEARNER_SLICES - 1))); do echo "$NAME-learner-$i"; done
}

rollout_nodes() {
  if [ "$ROLLOUT_SERVERS" -eq 1 ]; then echo "$NAME-rollout"; return; fi
  local i; for i in $(seq 0 $((ROLLOUT_SERVERS - 1))); do echo "$NAME-rollout-$i"; done
}

run() {  # runs a command, or prints it under --dry-run
  if [ "$DRY_RUN" -eq 1 ]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

gcloud_tpu() {  # gcloud compute tpus ARGS, with the experiment's project and zone
  run gcloud compute tpus "$@" --project="$PROJECT" --zone="$ZONE"
}

ssh_worker() {  # ssh_worker NODE WORKER COMMAND: runs COMMAND on one TPU VM worker ("all": every one)
  run gcloud compute tpus tpu-vm ssh "$1" --project="$PROJECT" --zone="$ZONE" --worker="$2" --command="$3"
}

worker_ips() {  # internal IPs of a node's workers, one per line (placeholders under --dry-run)
  local node="$1" accel="$2" i
  if [ "$DRY_RUN" -eq 1 ]; then
    for i in $(seq 0 $(($(hosts_of "$accel") - 1))); do echo "IP_OF_${node//-/_}_WORKER_$i"; done
    return
  fi
  gcloud compute tpus tpu-vm describe "$node" --project="$PROJECT" --zone="$ZONE" \
    --format='value(networkEndpoints[].ipAddress)' | tr ';' '\n'
}

confirm() {  # confirm PROMPT: yes with --yes or --dry-run (which changes nothing); else asks on a
  # terminal; refuses when stdin is not one
  [ "$ASSUME_YES" -eq 1 ] && return 0
  if [ "$DRY_RUN" -eq 1 ]; then
    echo "[dry run] would ask: $1" >&2
    return 0
  fi
  if [ ! -t 0 ]; then
    echo "refusing: $1 needs --yes when stdin is not a terminal" >&2
    exit 3
  fi
  local answer
  read -r -p "$1 [y/N] " answer
  [[ "$answer" =~ ^[Yy]$ ]]
}
