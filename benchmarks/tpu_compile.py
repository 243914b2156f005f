"""Every shipped TPU config compiled by the TPU compiler (libtpu) for its slices, on this machine:
per program the compiler's bytes per chip beside the estimate, FLOPs, roofline time and collectives,
and the projected rates (``asyncrl_jax.tpu.compile``). Compiler projections, not measurements.

  .venv/bin/python benchmarks/tpu_compile.py                      # every config (about an hour on 2 cores)
  .venv/bin/python benchmarks/tpu_compile.py --configs qwen2_5_1_5b_v6e.py
  .venv/bin/python benchmarks/tpu_compile.py --assemble-only      # the table from the recorded reports
  .venv/bin/python benchmarks/tpu_compile.py --roles rollout    # one role; the other from its record
  .venv/bin/python benchmarks/tpu_compile.py --learner-variants --configs qwen2_5_1_5b.py
      # the learner alone under each attention x remat choice, side by side (VARIANTS)

Each config's report is kept in ``results/tpu_compile/<config>.json`` (with commit, date, libtpu and
the compile seconds) and the table in ``results/tpu_compile.md`` is rebuilt from all of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402  pylint: disable=wrong-import-position

CONFIGS = ("qwen2_5_1_5b.py", "qwen2_5_1_5b_v6e.py", "r1_distill_qwen_7b_v5p.py", "r1_distill_qwen_7b_lora_v5p.py",
           "qwen3_8b_v5p.py", "qwen3_30b_a3b_v5p.py")
RECORDS = os.path.join(common.RESULTS_DIR, "tpu_compile")
GiB = 2**30
# (learner.attention, learner.remat) pairs compared by --learner-variants: the XLA reference first
VARIANTS = (("xla", "full"), ("splash", "full"), ("splash", "minimal"), ("splash", "dots_saveable"),
            ("splash", "minimal_offloaded"))


def compile_one(name: str, roles: tuple = ("learner", "rollout")) -> dict:
  """The config's report. A role not in ``roles`` is taken from the config's previous record (for a
  change that leaves its programs alone: the report says which commit compiled each role) and the
  projection recomputed by the current code."""
  from asyncrl_jax import config as config_lib, models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu import compile as tpu_compile, projection  # pylint: disable=import-outside-toplevel
  module = config_lib.config_module(name, beside=os.path.join(ROOT, "configs", name))
  accelerators = module.ACCELERATORS
  config = config_lib.validate(module.get_config())
  commit = common._commit()  # pylint: disable=protected-access  (the code that compiles)
  t0 = time.perf_counter()
  reused = [r for r in ("learner", "rollout") if r not in roles]
  previous = common.read_json(os.path.join(RECORDS, name.replace(".py", ".json"))) if reused else None
  report = tpu_compile.compile_config(config, accelerators["learner"], accelerators["rollout"],
                                      margin=accelerators.get("margin", 0.2), roles=tuple(roles),
                                      progress=lambda line: print(line, flush=True))
  report["role_commits"] = {r: commit for r in roles}
  for role in reused:
    report["roles"][role] = previous["roles"][role]
    report["role_commits"][role] = previous.get("role_commits", {}).get(role, previous["commit"])
  if reused:
    fits = all(r["fits"] for r in report["roles"].values())
    report["projection"] = projection.project(config, models.config_of(config), report["roles"]) if fits else None
  report.update(config=name, accelerators=accelerators, seconds=round(time.perf_counter() - t0),
                commit=commit,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine={k: v for k, v in common.machine().items() if k not in ("date", "commit")})
  return report


def learner_variants(name: str, variants=VARIANTS) -> dict:
  """The config's learner role compiled under each (attention, remat) pair, with its rates: which
  choice is fastest and fits, by the compiler's figures."""
  from asyncrl_jax import config as config_lib, models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu import compile as tpu_compile, projection  # pylint: disable=import-outside-toplevel
  module = config_lib.config_module(name, beside=os.path.join(ROOT, "configs", name))
  accelerators = module.ACCELERATORS
  rows = []
  t0 = time.perf_counter()
  for attention, remat in variants:
    config = module.get_config()
    config.learner.update(attention=attention, remat=remat)
    config = config_lib.validate(config)
    print(f"[tpu_compile] {name} learner attention={attention} remat={remat}", flush=True)
    try:
      report = tpu_compile.compile_config(config, accelerators["learner"], margin=accelerators.get("margin", 0.2),
                                          roles=("learner",), progress=lambda line: print(line, flush=True))
    except Exception as e:  # pylint: disable=broad-except  (a choice the compiler refuses is a result)
      rows.append({"attention": attention, "remat": remat, "error": f"{type(e).__name__}: {e}"[:600]})
      continue
    role = report["roles"]["learner"]
    rates = {}
    if role["fits"]:
      rates = projection.learner_rates(config, models.config_of(config), role)
    grad = next(p for p in role["programs"] if p["name"] == "grad_step[first]")
    rows.append({"attention": attention, "remat": remat, "fits": role["fits"],
                 "peak_bytes": role["peak_bytes"], "peak_program": role["peak_program"],
                 "grad_step": {k: grad.get(k) for k in ("compiled_bytes", "flops", "bytes_accessed",
                                                        "roofline_seconds", "bound", "kernels",
                                                        "compile_seconds", "refused")},
                 **rates})
  return {"config": name, "accelerators": accelerators, "variants": rows,
          "seconds": round(time.perf_counter() - t0), "commit": common._commit(),  # pylint: disable=protected-access
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "machine": {k: v for k, v in common.machine().items() if k not in ("date", "commit")}}


def variants_section(record: dict) -> list[str]:
  acc = record["accelerators"]
  lines = [f"### {record['config']}: the learner ({acc['learner']}) under each attention and remat choice",
           "", f"commit {record['commit']}, {record['date']}; one run, side by side "
           f"({record['seconds']} s of compiling).", "",
           "| attention | remat | fits | peak GiB per chip | grad step TFLOPs | GB moved | roofline ms "
           "| bound | learner tokens/s | MFU |", "|---|---|---|---|---|---|---|---|---|---|"]
  for v in record["variants"]:
    if "error" in v:
      lines.append(f"| {v['attention']} | {v['remat']} | error: {v['error'][:120]} |||||||")
      continue
    g = v["grad_step"]
    rate = (f"{v['learner_tokens_per_s']:,.0f} | {v['learner_mfu']:.1%}" if "learner_mfu" in v
            else "- | -")
    lines.append(f"| {v['attention']} | {v['remat']} | {'yes' if v['fits'] else 'no'} | "
                 f"{_gib(v['peak_bytes'])} | {g['flops'] / 1e12:.0f} | {g['bytes_accessed'] / 1e9:,.0f} | "
                 f"{g['roofline_seconds'] * 1e3:,.0f} | {g['bound']} | {rate} |")
  return lines + [""]


# The records before the kernels (results/tpu_compile/before/, compiled at 3b19c27) ran the configs
# as they were then: these fields differ from today's configs.
BEFORE = {"learner.attention": "xla", "learner.attention_chunk": 512, "rollout.decode_attention": "xla",
          "rollout.num_slots": 128}


def before_after_section() -> list[str]:
  """Per config, the programs compiled before the kernels and now, both projected by today's code
  (the honest MFU, the live-cache roofline, the planner): the change in one table."""
  from asyncrl_jax import config as config_lib, models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu import projection  # pylint: disable=import-outside-toplevel
  rows, targets = [], []
  for name in CONFIGS:
    before_path = os.path.join(RECORDS, "before", name.replace(".py", ".json"))
    after_path = os.path.join(RECORDS, name.replace(".py", ".json"))
    if not (os.path.exists(before_path) and os.path.exists(after_path)):
      continue
    module = config_lib.config_module(name, beside=os.path.join(ROOT, "configs", name))
    for label, path, overrides in (("before", before_path, BEFORE), ("after", after_path, {})):
      record = common.read_json(path)
      config = module.get_config()
      for key, value in overrides.items():
        section_name, field = key.split(".")
        config[section_name][field] = value
      config = config_lib.validate(config)
      if not all(r["fits"] for r in record["roles"].values()):
        rows.append(f"| {name} | {label} ({record['commit']}) | does not fit |||||||")
        continue
      p = projection.project(config, models.config_of(config), record["roles"])
      best = p["planner_best"]
      rows.append(
          f"| {name} | {label} ({record.get('role_commits', {}).get('learner', record['commit'])}) | "
          f"{_gib(record['roles']['learner']['peak_bytes'])} | {_gib(record['roles']['rollout']['peak_bytes'])} | "
          f"{p['learner_tokens_per_s']:,.0f} | {p['learner_mfu']:.1%} | "
          f"{p['decode_tokens_per_s']:,.0f} ({config.rollout.num_slots} slots) | "
          f"{p['decode_step_over_live_roofline']:.2f}x | {p['async_over_sync']:.2f}x ({p['sync_baseline']}) | "
          f"{best['learner_chips']}+{best['rollout_chips']} chips, eta {best['eta']}: {best['over_sync']:.2f}x |")
      if label == "after":
        targets.append(_targets(name, record, p))
  if not rows:
    return []
  return ["### Before and after the kernels", "",
          "The same arithmetic (`asyncrl_jax.tpu.projection` at the commit that assembled this page) on "
          "the programs compiled before the kernels (`results/tpu_compile/before/`, configs as they were: "
          + ", ".join(f"`{k}={v!r}`" for k, v in BEFORE.items()) + ") and now. MFU: 6 x parameters + "
          "causal attention within each sequence; decode step / live roofline: the compiled decode step "
          "against (serving weights + each slot's KV cache up to its live context) / HBM bandwidth; "
          "async / sync at the config's split; the planner's best split of the same chips.", "",
          "| config | compile | learner GiB per chip | decode GiB per chip | learner tokens/s | MFU | "
          "decode tokens/s per server | decode step / live roofline | async / sync (config's split) | "
          "planner's best |", "|---|---|---|---|---|---|---|---|---|---|"] + rows + [""] + [
              "Against the issue's targets (learner MFU >= 40% on v5p, as high as v6e allows; decode "
              "step within 1.3x of the live-cache roofline; async / sync >= 1.3x):", ""] + targets + [""]


def _targets(name: str, record: dict, p: dict) -> str:
  """One config's figures against the targets: met, or missed by how much and what bounds it."""
  learner = record["roles"]["learner"]
  grad = next(x for x in learner["programs"] if x["name"].startswith("grad_step"))
  mfu = p["learner_mfu"]
  if learner["chip"] == "v5p":
    mfu_text = (f"MFU {mfu:.1%}: met" if mfu >= 0.4 else
                f"MFU {mfu:.1%}: missed by {40 - 100 * mfu:.1f} points ({grad['bound']}-bound gradient step)")
  else:
    mfu_text = f"MFU {mfu:.1%} ({grad['bound']}-bound gradient step: what bounds it on {learner['chip']})"
  ratio = p["decode_step_over_live_roofline"]
  live = p["decode_live_bytes"]
  decode_text = (f"decode {ratio:.2f}x: met" if ratio <= 1.3 else
                 f"decode {ratio:.2f}x: missed by {100 * (ratio / 1.3 - 1):.0f}% (HBM-bound: the compiled step "
                 f"takes {ratio:.2f}x the time of reading the weights and live keys and values once, "
                 f"{(live['weights'] + live['kv']) / 1e9:.1f} GB" + _hbm_only(name) + ")")
  sync = p["async_over_sync"]
  sync_text = f"async / sync {sync:.2f}x: {'met' if sync >= 1.3 else 'missed'}"
  return f"* {name}: {mfu_text}; {decode_text}; {sync_text}."


def _hbm_only(name: str) -> str:
  """What ``decode_bytes`` found for ``name``'s decode step counting HBM traffic only ("" if not run)."""
  path = os.path.join(HERE, "results", "decode_bytes.json")
  if not os.path.exists(path):
    return "; where the excess goes is not broken down"
  record = next((r for r in common.read_json(path)["records"] if r["config"] == name), None)
  if record is None:
    return "; where the excess goes is not broken down"
  hbm = record["hbm_only"]["over_live"]
  return (f"; XLA's byte count includes the weights the compiler prefetches into on-chip VMEM, read "
          f"again from there: counting HBM traffic only the step is {hbm:.2f}x the roofline, "
          f"{'within' if hbm <= 1.3 else 'beyond'} the target ([decode_bytes](#decode_bytes))")


def _gib(x) -> str:
  return "-" if x is None else f"{x / GiB:.2f}"


def section(report: dict) -> list[str]:
  p = report["projection"]
  acc = report["accelerators"]
  lines = [f"### {report['config']}: learner {acc['learner']}, decode servers {acc['rollout']}", "",
           f"commit {report['commit']}, {report['date']}, libtpu {report['libtpu']}, jax {report['jax']}; "
           f"{report['model_parameters']:,} parameters; all programs compiled in {report['seconds']} s "
           f"on {report['machine'].get('cpu_count')} CPU cores.", "",
           "| role | program | compiled GiB | estimate GiB | estimate / compiled | with resident state GiB "
           "| TFLOPs | GB moved | roofline ms | bound | collectives (count) | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for role, r in report["roles"].items():
    for prog in r["programs"]:
      ratio = (f"{prog['estimate_bytes'] / prog['compiled_bytes']:.2f}" if prog["estimate_bytes"] else "-")
      coll = ", ".join(f"{k} {v['count']:,}" for k, v in prog["collectives"].items()) or "none"
      lines.append(f"| {role} | {prog['name']} | {_gib(prog['compiled_bytes'])} | "
                   f"{_gib(prog['estimate_bytes'])} | {ratio} | {_gib(prog['peak_bytes'])} | "
                   f"{prog['flops'] / 1e12:.2f} | {prog['bytes_accessed'] / 1e9:.1f} | "
                   f"{prog['roofline_seconds'] * 1e3:.1f} | {prog['bound']} | {coll} | "
                   f"{prog['compile_seconds']:.0f} |")
  for role, r in report["roles"].items():
    lines.append("")
    lines.append(f"{role}: {'fits' if r['fits'] else '**does not fit**'} one {r['chip']} chip "
                 f"({_gib(r['hbm_bytes'])} GiB) with {r['margin']:.0%} free: largest "
                 f"{r['peak_program']} at {_gib(r['peak_bytes'])} GiB with its resident state.")
  if p is None:
    return lines + ["", "No projection: a role does not fit.", ""]
  commits = report.get("role_commits") or {}
  if len(set(commits.values())) > 1:
    lines += ["", "(Roles compiled at different commits, each left alone by the changes since: "
              + ", ".join(f"{r} at {c}" for r, c in commits.items()) + ".)"]
  chunk = next(q for q in report["roles"]["rollout"]["programs"] if q["name"].startswith("decode_chunk"))
  paged = bool((chunk.get("kernels") or {}).get("paged_bytes"))
  lines += ["", f"Projection: learner {p['learner_tokens_per_s']:,.0f} tokens/s on {p['learner_chips']} "
            f"chips, **MFU {p['learner_mfu']:.1%}** (model FLOPs {p['model_flops_per_token']:.3g} per "
            f"token: 6 x parameters (4 x a frozen LoRA base) + causal attention within sequences at the token-weighted mean "
            f"length {p['attention_length']:,.0f}"
            + (f"; the splash kernel visits {p['splash_visited_fraction']:.0%} of its causal block pairs "
               "at these lengths" if p.get("splash_visited_fraction", 1) < 1 else "") + "); "
            f"decode {p['decode_tokens_per_s']:,.0f} tokens/s per server ({p['decode_step_seconds'] * 1e3:.1f} "
            + ("ms per step, the paged kernel reading each slot up to its position, at the mean live "
               "context" if paged else f"ms per step reading all {p['decode_context_length']:,} cache positions")
            + "; the live-cache "
            f"roofline at the mean live context {p['decode_live_context']:,.0f} is "
            f"{p['decode_live_step_seconds'] * 1e3:.1f} ms: **{p['decode_step_over_live_roofline']:.2f}x**); "
            f"async / sync {p['async_over_sync']:.2f}x on the config's {p['learner_chips']} learner + "
            f"{p['rollout_chips']} rollout chips (sync: {p['sync_baseline']}), {p['lengths']}.", ""]
  best = p.get("planner_best")
  if best:
    lines += [f"Planner (every legal learner slice and eta on the same {p['learner_chips'] + p['rollout_chips']} "
              f"chips): best **{best['learner_chips']} learner + {best['rollout_chips']} rollout chips at "
              f"eta {best['eta']}: {best['over_sync']:.2f}x** synchronous RL "
              f"({p['planner_sync']['kind']}).", ""]
  return lines


def _with_current_estimates(report: dict) -> dict:
  """The record's programs with ``asyncrl_jax.tpu.memory``'s estimates as the code computes them now
  (the compiled figures are the record's)."""
  from asyncrl_jax import config as config_lib, models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu import memory
  from asyncrl_jax.tpu import chips  # pylint: disable=import-outside-toplevel
  name = report["config"]
  config = config_lib.validate(config_lib.config_module(
      name, beside=os.path.join(ROOT, "configs", name)).get_config())
  acc = report["accelerators"]
  estimates = memory.program_estimates(config, models.config_of(config), chips.parse(acc["learner"])[1],
                                       chips.host_chips(acc["rollout"]))
  for role, r in report["roles"].items():
    for prog in r["programs"]:
      prog["estimate_bytes"] = estimates[role].get(prog["name"])
  return report


def assemble() -> str:
  reports = []
  for name in CONFIGS:
    path = os.path.join(RECORDS, name.replace(".py", ".json"))
    if os.path.exists(path):
      reports.append(_with_current_estimates(common.read_json(path)))
  lines = ["# tpu_compile", "",
           "The shipped TPU configs' per-step programs compiled by the TPU compiler (libtpu) for their "
           "slices on a CPU machine (`python -m asyncrl_jax info --compile`): **compiler projections, "
           "not measurements on a TPU**. Compiled bytes are per chip (arguments + outputs + temporaries "
           "- donated); the estimate is `asyncrl_jax.tpu.memory`'s for the same program; 'with resident "
           "state' adds what the role holds beside the program (optimizer state, gradient sum, the "
           "version's batch), computed by the code at the commit that assembled this page. FLOPs and bytes are per chip with loops counted as often as they run "
           "(XLA's own figures count a loop body once); roofline = max(FLOPs / peak bf16, bytes / HBM "
           "bandwidth) with `asyncrl_jax.tpu.chips.CHIPS` (Cloud TPU's published figures). Decode "
           "servers' prefill programs: the widest shape of each row count (`--shapes=covering`).", ""]
  if not reports:
    lines.append("(not run yet: `.venv/bin/python benchmarks/tpu_compile.py` after `bash launch/setup.sh "
                 "--tpu-compile`)")
  lines += before_after_section()
  for report in reports:
    lines += section(report)
  for name in CONFIGS:
    path = os.path.join(RECORDS, name.replace(".py", ".learner_variants.json"))
    if os.path.exists(path):
      lines += variants_section(common.read_json(path))
  path = os.path.join(common.RESULTS_DIR, "tpu_compile.md")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return path


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
  parser.add_argument("--assemble-only", action="store_true")
  parser.add_argument("--roles", nargs="+", default=["learner", "rollout"], choices=["learner", "rollout"],
                      help="compile these roles; take the others' programs from the config's record")
  parser.add_argument("--learner-variants", action="store_true",
                      help="compile the learner alone under each (attention, remat) choice in VARIANTS")
  args = parser.parse_args()
  if args.learner_variants:
    os.makedirs(RECORDS, exist_ok=True)
    for name in args.configs:
      record = learner_variants(name)
      with open(os.path.join(RECORDS, name.replace(".py", ".learner_variants.json")), "w") as f:
        json.dump(record, f, indent=1)
  elif not args.assemble_only:
    os.makedirs(RECORDS, exist_ok=True)
    for name in args.configs:
      print(f"[tpu_compile] {name}", flush=True)
      report = compile_one(name, roles=tuple(args.roles))
      with open(os.path.join(RECORDS, name.replace(".py", ".json")), "w") as f:
        json.dump(report, f, indent=1)
  print(f"wrote {assemble()}")


if __name__ == "__main__":
  main()
