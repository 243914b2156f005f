"""Why greedy accuracy falls under RL while pass@1 rises: the warm start's greedy completions against
a trained run's, problem by problem, on the built-in arithmetic task.

  .venv/bin/python benchmarks/greedy_diagnosis.py --run RUN_WORKDIR [--run ...] [--out NAME]

Each ``--run`` is a finished main-job workdir that started from a warm start (``model.hf_path``, as
the staleness arms do); its newest checkpoint is compared with that warm start on the run's held-out
problems (all of them). Each greedy completion is classified by its first mistake (``classify``):
an addition error, a term error (a term skipped, repeated or misread, or a wrong sum carried), a
chain of the wrong length, an answer that is not the last sum, or a malformed completion. For the first wrong token of each greedy completion the script
also records the probability the model gave the token it chose and the correct one (at temperature
1: the distribution the policy is trained on), and the entropy of the greedy completions' tokens.
Writes benchmarks/results/NAME.{json,md} (default greedy_diagnosis).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(1)

from benchmarks.common import machine, write_result  # noqa: E402  pylint: disable=wrong-import-position

KINDS = ("correct", "addition error", "term error", "chain length", "answer not the last sum",
         "malformed")


def classify(problem: dict, completion: str) -> str:
  """Where a greedy completion of ``problem`` (question ``a+b+c=``, solution ``a+b=s;s+c=t;#t``) goes
  wrong: "correct" (its answer is right), an "addition error" (a step ``x+y=z`` with z != x + y),
  a "term error" (a step that adds correctly but starts from a sum other than the last one or adds a
  term other than the next: one skipped, repeated or misread), "chain length" (every step right,
  too few or too many of them), "answer not the last sum", or "malformed" (no ``#`` answer, or a
  step that does not parse)."""
  chain, hashed, answer = completion.partition("#")
  if hashed and answer.strip() == problem["answer"]:
    return "correct"
  if not hashed:
    return "malformed"
  terms = [int(t) for t in problem["question"].rstrip("=").split("+")]
  steps = [x for x in chain.split(";") if x]
  total = terms[0]
  try:
    for k, step in enumerate(steps):
      left, _, z = step.partition("=")
      x, _, y = left.partition("+")
      x, y, z = int(x), int(y), int(z)
      if x + y != z:
        return "addition error"
      if x != total or k + 1 >= len(terms) or y != terms[k + 1]:
        return "term error"
      total = z
    value = int(answer)
  except ValueError:
    return "malformed"
  if len(steps) != len(terms) - 1:
    return "chain length"
  return "answer not the last sum" if value != total else "correct"


def _token_stats(model_config, params, tokenizer, prompt_ids, completions, solutions):
  """Per completion: mean entropy (T=1) of its tokens, and at the first wrong token the probability
  of the chosen token and of the correct one (None where the completion is right)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  out = []
  fwd = jax.jit(lambda p, t: jax.nn.log_softmax(models.logits(model_config, p, t)[0], axis=-1))
  for prompt, completion, want in zip(prompt_ids, completions, solutions):
    ids = list(prompt) + list(completion)
    width = 1 << max(5, (len(ids) - 1).bit_length())
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(ids)] = ids
    logp = np.asarray(fwd(params, jnp.asarray(tokens)))
    start = len(prompt) - 1  # the row predicting the first completion token
    rows = logp[start:start + len(completion)]
    p = np.exp(rows)
    entropy = float(np.mean(-(p * rows).sum(-1))) if len(rows) else 0.0
    chosen = correct = None
    want_ids = tokenizer.encode(want) + [tokenizer.eos_id]
    k = next((i for i, (a, b) in enumerate(zip(completion, want_ids)) if a != b), None)
    if k is not None:
      chosen, correct = float(p[k, completion[k]]), float(p[k, want_ids[k]])
    out.append(dict(entropy=entropy, p_chosen=chosen, p_correct=correct))
  return out


def diagnose(workdir: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.data import builder as builder_lib, pipeline  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.infra import sharding  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl.evaluation import Evaluator  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl.rewards import reward_fn  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tokenization import load_tokenizer  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tools import export  # pylint: disable=import-outside-toplevel
  config = export.run_config(workdir)
  if config.data.task != "arithmetic" or not config.model.hf_path:
    raise SystemExit(f"{workdir}: needs a run of the built-in arithmetic task from a warm start "
                     "(model.hf_path)")
  model_config, trained, step = export.restore_params(workdir)
  _, warm = models.load_hf(config.model.hf_path, dtype=config.model.dtype, param_dtype=config.model.param_dtype)
  mesh = sharding.make_mesh(jax.devices()[:1], dict(data=1, fsdp=1, tensor=1))
  b = builder_lib.from_config(config, os.path.dirname(config.data.path))
  problems = pipeline.read_split(b, builder_lib.held_out_split(b), config.data.num_test)
  tokenizer = load_tokenizer(config.data.tokenizer_path)
  ev = Evaluator(model_config, mesh, tokenizer, problems, max_prompt_len=config.data.max_prompt_len,
                 max_new_tokens=config.data.max_completion_len)
  sides = {}
  for name, params in (("warm start", warm), (f"version {step}", trained)):
    if name == "warm start" and model_config.lora:
      from asyncrl_jax.models import lora  # pylint: disable=import-outside-toplevel
      params = lora.add_adapters(model_config, params, jax.random.key(0))
    ev.evaluate(params, reward_fn("arithmetic"))
    texts = [tokenizer.decode(c) for _, c, _ in ev.last_samples]
    kinds = [classify(p, t) for p, t in zip(problems, texts)]
    stats = _token_stats(model_config, params, tokenizer, ev.prompt_ids,
                         [list(c) for _, c, _ in ev.last_samples], [p["solution"] for p in problems])
    sides[name] = dict(kinds=kinds, texts=texts, stats=stats, n_terms=[int(p["num_terms"]) for p in problems])
  return dict(workdir=workdir, step=step, sides=sides)


def summarize(result: dict) -> dict:
  names = list(result["sides"])
  out = {}
  for name in names:
    side = result["sides"][name]
    kinds = collections.Counter(side["kinds"])
    wrong = [s for s, k in zip(side["stats"], side["kinds"]) if k != "correct" and s["p_chosen"] is not None]
    out[name] = dict(
        greedy=kinds["correct"] / len(side["kinds"]),
        kinds={k: kinds[k] for k in KINDS},
        entropy=float(np.mean([s["entropy"] for s in side["stats"]])),
        first_error_p_chosen=float(np.median([s["p_chosen"] for s in wrong])) if wrong else None,
        first_error_p_correct=float(np.median([s["p_correct"] for s in wrong])) if wrong else None,
        mean_length=float(np.mean([len(t) for t in side["texts"]])))
  a, b = (result["sides"][n]["kinds"] for n in names)
  flips = collections.Counter(kb for ka, kb in zip(a, b) if ka == "correct" and kb != "correct")
  gains = sum(1 for ka, kb in zip(a, b) if ka != "correct" and kb == "correct")
  terms = np.asarray(result["sides"][names[0]]["n_terms"])
  by_terms = {}
  for lo, hi in ((2, 4), (5, 8), (9, 16)):
    sel = (terms >= lo) & (terms <= hi)
    by_terms[f"{lo}-{hi}"] = [float(np.mean([k == "correct" for k, s in zip(result["sides"][n]["kinds"], sel) if s]))
                              for n in names]
  ta, tb = (result["sides"][n]["texts"] for n in names)
  examples = [dict(warm=x, trained=y) for x, y, ka, kb in zip(ta, tb, a, b)
              if ka == "correct" and kb != "correct"][:12]
  return dict(sides=out, lost=dict(flips), gained=gains, by_terms=by_terms, lost_examples=examples)


NOTE = ("Greedy completions on every held-out problem, the warm start against the run's last version "
        "(decoded here on one device: a few near-tied argmaxes can differ from the run's own final "
        "evaluation). Kinds: a wrong completion's first mistake. Entropy: mean per-token entropy (T=1) "
        "along the greedy completion. At the first wrong token: median probability (T=1) of the token "
        "greedy chose and of the correct one. Per run in the JSON: correct completions lost and gained, "
        "greedy accuracy by number of terms, examples of lost ones.")


def write(runs: list, out: str) -> None:
  rows = []
  for r in runs:
    for name, side in r["sides"].items():
      rows.append([os.path.basename(os.path.normpath(r["workdir"])), name, f"{100 * side['greedy']:.1f}",
                   *(side["kinds"][k] for k in KINDS[1:]), f"{side['entropy']:.3f}",
                   "-" if side["first_error_p_chosen"] is None else f"{side['first_error_p_chosen']:.2f}",
                   "-" if side["first_error_p_correct"] is None else f"{side['first_error_p_correct']:.2f}",
                   f"{side['mean_length']:.1f}"])
  write_result(out, dict(machine=machine(), config=dict(runs=[r["workdir"] for r in runs]), runs=runs,
                         note=NOTE),
               ["run", "model", "greedy %", *KINDS[1:], "entropy", "p(chosen) at 1st error",
                "p(correct) at 1st error", "mean chars"], rows, notes=NOTE)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--run", action="append", default=[], help="a finished run's workdir (repeat)")
  p.add_argument("--out", default="greedy_diagnosis")
  p.add_argument("--assemble-only", action="store_true", help="rewrite NAME.md from NAME.json")
  args = p.parse_args(argv)
  if args.assemble_only:
    from benchmarks.common import RESULTS_DIR, read_json  # pylint: disable=import-outside-toplevel
    write(read_json(os.path.join(RESULTS_DIR, f"{args.out}.json"))["runs"], args.out)
    return 0
  if not args.run:
    raise SystemExit("--run WORKDIR is required (or --assemble-only)")
  runs = []
  for workdir in args.run:
    r = diagnose(workdir)
    s = summarize(r)
    runs.append(dict(workdir=workdir, step=r["step"], **s))
    print(f"[greedy] {workdir}: lost {s['lost']}, gained {s['gained']}, by terms {s['by_terms']}", flush=True)
  write(runs, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
