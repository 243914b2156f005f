#!/usr/bin/env bash
# Accelerator benchmarks at a realistic size (Qwen2.5-0.5B shape, random bf16 weights), one device.
# From the repository root, on the GPU machine (JAX's CUDA build, no network), after prepare.sh:
#   bash benchmarks/gpu/run.sh [OUT_DIR]          # about 5 minutes on one H200
# Writes gpu_*.{json,md,png} to OUT_DIR (default benchmarks/results); run_all.py --assemble-only
# collects them into RESULTS.md.
set -euo pipefail
out=${1:-${OUT:-benchmarks/results}}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
python3 -c "import jax; print(jax.__version__, jax.devices())"
# decode: the engine's server vs a fused loop, 128 slots, 256 new tokens
timeout 240 python3 benchmarks/engine_throughput.py --model qwen2.5-0.5b --dtype bfloat16 --slots 128 \
  --new_tokens 256 --repeats 2 --name gpu_engine_qwen2.5-0.5b --out "$out"
# learner: one policy update of 256 heavy-tailed sequences (median 512 tokens, cap 4096)
timeout 240 python3 benchmarks/learner_throughput.py --model qwen2.5-0.5b --dtype bfloat16 --batch 256 \
  --token_budget 32768 --median 512 --sigma 1.0 --cap 4096 --repeats 3 --name gpu_learner_qwen2.5-0.5b --out "$out"
# the planner on these measured rates (a prediction, labelled as such in its output)
python3 - "$out" <<'PY'
import json, subprocess, sys
out = sys.argv[1]
eng = json.load(open(f"{out}/gpu_engine_qwen2.5-0.5b.json"))
lrn = json.load(open(f"{out}/gpu_learner_qwen2.5-0.5b.json"))
cmd = [sys.executable, "-m", "asyncrl_jax.sim.planner", "--devices", "8", "--decode-tok-s", str(eng["engine_tok_s"]),
       "--train-tok-s", str(lrn["policy_tokens_per_s"]), "--slots-per-device", "128", "--batch", "512",
       "--mu", "6.2", "--sigma", "1.0", "--cap", "4096", "--epochs", "60"]
text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
with open(f"{out}/gpu_planner.md", "w") as f:
  f.write("# gpu_planner\n\nPlanner prediction for 8 such devices from the rates measured above "
          "(a prediction, not a measurement).\n\n```\n" + "\n".join(l for l in text.splitlines() if not l.startswith("{")) + "\n```\n")
print(text)
PY
