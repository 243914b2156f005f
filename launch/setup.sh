#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs asyncrl_jax with every dependency pinned.
#   bash launch/setup.sh          runtime dependencies (enough to run the main job)
#   bash launch/setup.sh --test   plus the test-only dependencies (pytest, chex, torch CPU, transformers)
#                                 and the TPU compiler (libtpu), which the tests of `info --compile` use
#   bash launch/setup.sh --tpu-compile   runtime dependencies and the TPU compiler only
# Safe to re-run: pip skips what is already installed at the pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  ""|--test|--tpu-compile) ;;
  *) echo "error: unknown option ${1}; use --test or --tpu-compile" >&2; exit 2 ;;
esac

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "error: asyncrl_jax needs Python 3.11 (jax 0.10.2); $PYTHON is $("$PYTHON" --version 2>&1)" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

echo "[setup] installing pinned runtime dependencies (requirements.txt)"
"${PIP[@]}" -r requirements.txt
# google-jetstream without its seqio -> TensorFlow chain; see asyncrl_jax/rollout/jetstream_compat.py.
"${PIP[@]}" --no-deps -r requirements-jetstream.txt
"${PIP[@]}" --no-deps --no-build-isolation -e . 2>/dev/null || "${PIP[@]}" --no-deps -e .

if [ "${1:-}" = "--test" ]; then
  echo "[setup] installing pinned test dependencies (requirements-test.txt)"
  "${PIP[@]}" -r requirements-test.txt
fi
if [ "${1:-}" = "--test" ] || [ "${1:-}" = "--tpu-compile" ]; then
  echo "[setup] installing the TPU compiler (requirements-tpu.txt: libtpu, about 700 MB)"
  "${PIP[@]}" -r requirements-tpu.txt
fi
echo "[setup] done: .venv/bin/python -m asyncrl_jax --help"
