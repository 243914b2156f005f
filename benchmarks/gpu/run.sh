#!/usr/bin/env bash
# Accelerator benchmarks at a realistic size (Qwen2.5-0.5B shape, random bf16 weights), one device.
# From the repository root, on the GPU machine (JAX's CUDA build, no network), after prepare.sh:
#   bash benchmarks/gpu/run.sh [OUT_DIR]          # about 8 minutes on one H200 (estimated; not yet run there)
# Writes gpu_*.{json,md,png} to OUT_DIR (default benchmarks/results); run_all.py --assemble-only
# collects them into RESULTS.md. The sizes can be changed through the environment, e.g. a CPU dry run:
#   MODEL=demo DTYPE=float32 SLOTS=8 NEW_TOKENS=16 BATCH=16 BUDGET=2048 MEDIAN=16 CAP=64 \
#     ASYNC_MODEL="--config.model.num_layers=2" bash benchmarks/gpu/run.sh /tmp/gpu_dry
# ASYNC=0 skips the async-vs-sync step.
set -euo pipefail
out=${1:-${OUT:-benchmarks/results}}
model=${MODEL:-qwen2.5-0.5b}
dtype=${DTYPE:-bfloat16}
slots=${SLOTS:-128}
new_tokens=${NEW_TOKENS:-256}
batch=${BATCH:-256}
budget=${BUDGET:-32768}
median=${MEDIAN:-512}
cap=${CAP:-4096}
# the wheels from prepare.sh are for the GPU image's Python 3.12
if [ -d .whl ] && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
python3 -c "import jax; print(jax.__version__, jax.devices())"
# decode: the engine's server vs a fused loop
timeout 240 python3 benchmarks/engine_throughput.py --model "$model" --dtype "$dtype" --slots "$slots" \
  --new_tokens "$new_tokens" --repeats 2 --name "gpu_engine_$model" --out "$out"
# learner: one policy update of heavy-tailed sequences
timeout 240 python3 benchmarks/learner_throughput.py --model "$model" --dtype "$dtype" --batch "$batch" \
  --token_budget "$budget" --median "$median" --sigma 1.0 --cap "$cap" --repeats 3 \
  --name "gpu_learner_$model" --out "$out"
# the planner on these measured rates (a prediction, labelled as such in its output)
python3 - "$out" "$model" "$slots" "$median" "$cap" <<'PY'
import json, math, subprocess, sys
sys.path.insert(0, ".")
from benchmarks.run_all import planner_md
out, model, slots, median, cap = sys.argv[1:]
eng = json.load(open(f"{out}/gpu_engine_{model}.json"))
lrn = json.load(open(f"{out}/gpu_learner_{model}.json"))
args = ["--devices", "8", "--decode-tok-s", str(eng["engine_tok_s"]), "--train-tok-s",
        str(lrn["policy_tokens_per_s"]), "--slots-per-device", slots, "--batch", "512",
        "--mu", f"{math.log(float(median)):.3f}", "--sigma", "1.0", "--cap", cap, "--epochs", "60"]
text = subprocess.run([sys.executable, "-m", "asyncrl_jax.sim.planner", *args], capture_output=True,
                      text=True, check=True).stdout
planner_md(text, args, f"Planner prediction for 8 devices like this one, from the rates measured above "
           f"({model}; a prediction, not a measurement).", name=f"gpu_planner_{model}", out_dir=out)
print(text)
PY
# async vs sync: the main job on the built-in task (its own warm start, eta 0 and 2), decode server and
# learner colocated on this one device (they take turns, as on a CPU), with a Qwen2.5-0.5B-wide model
# over the built-in 17-token vocabulary
if [ "${ASYNC:-1}" = 1 ]; then
  async_model=${ASYNC_MODEL:-"--config.model.hidden_size=896 --config.model.intermediate_size=4864 \
--config.model.num_layers=24 --config.model.num_heads=14 --config.model.num_kv_heads=2 \
--config.learner.warm_start_lr=3e-4"}
  # rollout.warm_up=False: compile prefill shapes when first wanted (in the background) rather than all
  # of them up front, which at this depth could take minutes of the time budget
  overrides=(--override=--config.mesh.colocate=True --override=--config.rollout.warm_up=False)
  for o in $async_model; do overrides+=("--override=$o"); done
  timeout 360 python3 benchmarks/async_vs_sync.py --quick --name gpu_async_vs_sync --out "$out" "${overrides[@]}"
fi
