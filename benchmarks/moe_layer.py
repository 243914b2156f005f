"""MoE layer on CPU: the grouped expert path (``ragged_dot``) against the dense reference, same run.

  .venv/bin/python benchmarks/moe_layer.py [--quick]
  .venv/bin/python benchmarks/moe_layer.py --cells 4096,128,8 --repeats 3   # N,E,k of your own

For each cell (``N`` tokens, ``E`` experts, top ``k``; hidden ``D``, expert width ``F``) the layer's
expert half (``asyncrl_jax.models.moe``): random router logits ``[N, E]`` routed by ``moe.route``
(softmax, top k, weights renormalised), then ``experts_grouped`` or ``experts_dense`` on the same
inputs and weights. Both run as jitted programs:

* **check**: the grouped output and the gradients of ``sum(y * c)`` (``c`` a fixed random cotangent)
  with respect to the tokens, the logits and the three expert kernels must equal the dense
  reference's: max |grouped - dense| over max |dense| below ``--tol`` (raises otherwise);
* **time**: the forward and the forward + backward (``jax.grad`` of that scalar) of each path, after
  one warm-up call, in alternating order, median of ``--repeats``; microseconds per token;
* **FLOPs**: nominal (what the algorithm needs: the dense path runs every expert on every token, ``E /
  k`` times the grouped path's ``N k`` rows) beside XLA's own count of the compiled programs (what
  this backend executes).

Off TPU and GPU, jax (0.10) lowers ``ragged_dot`` generically: the ``[N k, D]`` operand expanded to a
masked ``[E, N k, D]`` and contracted over experts too, so on CPU the grouped path executes ``E N k``
rows, k times the dense path's ``N E``, and costs memory and time in ``N E k``: the default cells keep
that at most 262144 (``--cells 4096,128,8`` needs about 4 GiB per expanded operand).

Writes benchmarks/results/moe_layer.{json,md}; prints one JSON object (last line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl_jax import cli  # noqa: E402  pylint: disable=wrong-import-position

cli.ensure_cpu_devices(1)

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from asyncrl_jax.models import moe  # noqa: E402
from benchmarks import common  # noqa: E402

PATHS = {"dense": moe.experts_dense, "grouped": moe.experts_grouped}
# (N, E, k): tokens at E 32, k 2; experts at N 256, k 2; top k at N 256, E 32; Qwen3-MoE's E 128, k 8.
# About 3 minutes on 2 cores (the grouped path's cost on CPU grows as N E k: see the module docstring).
CELLS = ((256, 32, 2), (1024, 32, 2), (4096, 32, 2), (256, 8, 2), (256, 128, 2), (256, 32, 8),
         (256, 128, 8))
QUICK_CELLS = ((64, 16, 4),)  # one cell: compiling its 4 programs is most of the time
GRAD_NAMES = ("x", "logits", "gate", "up", "down")


def layer(path, k: int):
  """``(x_nd, logits_ne, gate_edf, up_edf, down_efd) -> y_nd``: routing and one expert path."""
  def fn(x_nd, logits_ne, gate_edf, up_edf, down_efd):
    experts_nk, weights_nk, _ = moe.route(logits_ne, k, norm_topk_prob=True)
    return path(x_nd, experts_nk, weights_nk, gate_edf, up_edf, down_efd)
  return fn


def inputs(n: int, e: int, d: int, f: int, seed: int = 0) -> tuple:
  """Tokens, router logits, kernels scaled so every activation is O(1), and the cotangent ``c``."""
  ks = jax.random.split(jax.random.key(seed), 6)
  normal = lambda key, shape, fan_in: jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)
  return (normal(ks[0], (n, d), 1), normal(ks[1], (n, e), 1), normal(ks[2], (e, d, f), d),
          normal(ks[3], (e, d, f), d), normal(ks[4], (e, f, d), f)), normal(ks[5], (n, d), 1)


def nominal_flops(n: int, e: int, k: int, d: int, f: int) -> dict:
  """Forward FLOPs of the expert matmuls and the combine: ``rows (6 D F + 2 D)``, rows = ``N E``
  (dense) or ``N k`` (grouped). Routing (the same in both) left out."""
  return {"dense": n * e * (6 * d * f + 2 * d), "grouped": n * k * (6 * d * f + 2 * d)}


def _compile(fn, args):
  t = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  seconds = time.perf_counter() - t
  cost = compiled.cost_analysis()
  cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
  flops = cost.get("flops")
  return compiled, (float(flops) if flops is not None else None), seconds


def _max_diff(got, ref) -> dict:
  got, ref = np.asarray(got), np.asarray(ref)
  return {"max_abs_diff": float(np.max(np.abs(got - ref))), "ref_max_abs": float(np.max(np.abs(ref)))}


def measure(n: int, e: int, k: int, d: int, f: int, repeats: int, tol: float) -> dict:
  """One cell: the check, then both paths' forward and forward + backward, timed side by side."""
  args, cot_nd = inputs(n, e, d, f)
  fwd = {path: layer(expert_fn, k) for path, expert_fn in PATHS.items()}
  kinds = {"fwd": (fwd, args),
           "fwd+bwd": ({path: jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a[:-1]) * a[-1]),
                                       argnums=tuple(range(len(args)))) for path, fn in fwd.items()},
                       args + (cot_nd,))}
  programs, flops, compile_s, check = {}, {}, {}, {}
  for kind, (fns, fn_args) in kinds.items():  # the forward checked before the backward is compiled
    warm = {}
    for path, fn in fns.items():
      compiled, flops[path, kind], compile_s[path, kind] = _compile(fn, fn_args)
      programs[path, kind] = lambda compiled=compiled, fn_args=fn_args: compiled(*fn_args)
      warm[path] = jax.block_until_ready(programs[path, kind]())  # warm-up, and the values checked
    if kind == "fwd":
      check["y"] = _max_diff(warm["grouped"], warm["dense"])
    else:
      for name, got, ref in zip(GRAD_NAMES, warm["grouped"], warm["dense"]):
        check[f"grad_{name}"] = _max_diff(got, ref)
    for what, c in check.items():
      if not c["max_abs_diff"] <= tol * c["ref_max_abs"]:
        raise AssertionError(f"moe_layer N={n} E={e} k={k}: grouped and dense {what} differ by "
                             f"{c['max_abs_diff']:.3g} (max |dense| {c['ref_max_abs']:.3g}, tolerance "
                             f"{tol:g} of it)")
  runs = {key: [] for key in programs}
  for r in range(repeats):
    for key in (list(programs) if r % 2 == 0 else list(programs)[::-1]):
      t = time.perf_counter()
      jax.block_until_ready(programs[key]())
      runs[key].append(time.perf_counter() - t)
  seconds = {key: float(np.median(v)) for key, v in runs.items()}
  nominal = nominal_flops(n, e, k, d, f)
  out = {"tokens": n, "experts": e, "top_k": k, "check": check,
         "max_rel_diff": max(c["max_abs_diff"] / c["ref_max_abs"] for c in check.values())}
  for kind in ("fwd", "fwd+bwd"):
    dense, grouped = ("dense", kind), ("grouped", kind)
    out[kind] = {
        "us_per_token": {p: seconds[p, kind] / n * 1e6 for p in PATHS},
        "time_ratio": seconds[dense] / seconds[grouped],  # dense / grouped: > 1, grouped faster
        "xla_flops": {p: flops[p, kind] for p in PATHS},
        "xla_flop_ratio": (flops[dense] / flops[grouped] if flops[dense] and flops[grouped] else None),
        "xla_gflops_per_s": {p: (flops[p, kind] / seconds[p, kind] / 1e9 if flops[p, kind] else None)
                             for p in PATHS},
        "compile_seconds": {p: compile_s[p, kind] for p in PATHS},
        "runs_seconds": {p: runs[p, kind] for p in PATHS},
    }
  out["nominal_flops_fwd"] = nominal
  out["nominal_flop_ratio"] = nominal["dense"] / nominal["grouped"]
  out["grouped_xla_over_nominal_fwd"] = (flops["grouped", "fwd"] / nominal["grouped"]
                                         if flops["grouped", "fwd"] else None)
  return out


def _parse_cell(text: str) -> tuple:
  try:
    n, e, k = (int(v) for v in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"--cells takes N,E,k (e.g. 1024,32,2), not {text!r}") from None
  if not 1 <= k <= e:
    raise argparse.ArgumentTypeError(f"--cells {text}: top k must be in [1, E]")
  return n, e, k


def _ratio(x) -> str:
  return "-" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help=f"cells {QUICK_CELLS}, 2 repeats (a smoke test)")
  p.add_argument("--cells", nargs="+", type=_parse_cell, default=None,
                 help=f"N,E,k per cell (tokens, experts, top k); default {CELLS}")
  p.add_argument("--hidden", type=int, default=256, help="D")
  p.add_argument("--width", type=int, default=128, help="F, each expert's intermediate size")
  p.add_argument("--repeats", type=int, default=None, help="timed calls per program (default 5, quick 2)")
  p.add_argument("--tol", type=float, default=1e-4,
                 help="largest max |grouped - dense| allowed, as a fraction of max |dense|")
  p.add_argument("--name", default="moe_layer")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  cells = args.cells or (QUICK_CELLS if args.quick else CELLS)
  repeats = args.repeats or (2 if args.quick else 5)
  d, f = args.hidden, args.width
  results = []
  for n, e, k in cells:
    t = time.perf_counter()
    r = measure(n, e, k, d, f, repeats, args.tol)
    results.append(r)
    print(f"[moe_layer] N={n} E={e} k={k}: fwd {r['fwd']['us_per_token']['dense']:.2f} / "
          f"{r['fwd']['us_per_token']['grouped']:.2f} us/token (dense / grouped), fwd+bwd "
          f"{r['fwd+bwd']['us_per_token']['dense']:.2f} / {r['fwd+bwd']['us_per_token']['grouped']:.2f}; "
          f"max rel diff {r['max_rel_diff']:.1e} ({time.perf_counter() - t:.0f}s)", flush=True)
  config = {"cells": [list(c) for c in cells], "hidden": d, "width": f, "repeats": repeats, "tol": args.tol,
            "dtype": "float32", "norm_topk_prob": True, "quick": args.quick,
            "moe_code": common.code_commit(("asyncrl_jax/models/moe.py",))}
  load = os.getloadavg()[0]  # other work on the machine slows both paths alike, not their ratio
  result = {"benchmark": "moe_layer", "machine": common.machine(), "config": config, "load_average": load,
            "cells": results}
  rows = []
  for r in results:
    fwd, both = r["fwd"], r["fwd+bwd"]
    rows.append([r["tokens"], r["experts"], r["top_k"],
                 fwd["us_per_token"]["dense"], fwd["us_per_token"]["grouped"],
                 _ratio(fwd["time_ratio"]),
                 both["us_per_token"]["dense"], both["us_per_token"]["grouped"],
                 _ratio(both["time_ratio"]), _ratio(r["nominal_flop_ratio"]),
                 f"{_ratio(fwd['xla_flop_ratio'])} / {_ratio(both['xla_flop_ratio'])}",
                 f"{r['check']['y']['max_abs_diff']:.1e} / {r['max_rel_diff']:.1e}"])
  header = ["N", "E", "k", "fwd us/token dense", "fwd grouped", "fwd dense / grouped",
            "fwd+bwd us/token dense", "fwd+bwd grouped", "fwd+bwd dense / grouped",
            "FLOP ratio nominal (E / k)", "FLOP ratio XLA fwd / fwd+bwd", "max abs diff y / max rel diff"]
  per_e = [r["grouped_xla_over_nominal_fwd"] / r["experts"] for r in results
           if r["grouped_xla_over_nominal_fwd"] is not None]
  span = "" if not per_e else (f"{min(per_e):.2f}" if f"{min(per_e):.2f}" == f"{max(per_e):.2f}"
                                else f"{min(per_e):.2f}-{max(per_e):.2f}")
  here = f" Here XLA counts the grouped forward at {span} x E times its nominal FLOPs." if per_e else ""
  notes = ("The MoE layer's expert half (`models/moe.py`): random router logits routed by `moe.route` "
           "(softmax, top k, renormalised), then the grouped path (`experts_grouped`, `jax.lax.ragged_dot`) "
           f"or the dense reference (`experts_dense`, every expert on every token), float32, D={d}, F={f}, "
           f"on {jax.devices()[0].platform.upper()}. Microseconds per token, median of {repeats} calls "
           "after a warm-up, both paths in alternating order in the same run (load average "
           f"{load:.1f} on {os.cpu_count()} cores at the end: other work slows both alike); ratios dense / "
           "grouped (> 1: grouped faster). Nominal FLOPs are what the algorithm needs (the dense path's E / "
           "k times the grouped path's); XLA's are the compiled programs' own count, what this backend "
           "executes: a grouped count near E times the nominal means `ragged_dot` was lowered as a masked "
           f"dense product over every expert (jax's generic lowering, used off TPU and GPU).{here} Last "
           "column: the output's max |grouped - dense|, and the largest relative one over the output and "
           f"the gradients (tokens, logits, the three kernels); the run stops if any exceeds {args.tol:g}.")
  kwargs = {"out_dir": args.out} if args.out else {}
  path = common.write_result(args.name, result, header, rows, notes, **kwargs)
  print(f"[moe_layer] wrote {path}")
  print(json.dumps({f"{r['tokens']},{r['experts']},{r['top_k']}": {
      "fwd_ratio": r["fwd"]["time_ratio"], "fwd_bwd_ratio": r["fwd+bwd"]["time_ratio"],
      "nominal_flop_ratio": r["nominal_flop_ratio"], "xla_flop_ratio": r["fwd"]["xla_flop_ratio"],
      "max_rel_diff": r["max_rel_diff"]} for r in results}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
