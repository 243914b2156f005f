"""``python -m asyncrl_jax.tools.info --config=configs/x.py [--accelerator=v5p-32 --rollout_accelerator=v5p-8]``:
the validated config and the model size; with an accelerator, the memory estimate per device of each
role (``asyncrl_jax.tpu.memory``) and whether it fits one chip's HBM with ``--margin`` to spare.

The learner spans every chip of ``--accelerator``; each decode server is one host of
``--rollout_accelerator`` (default: the learner's type, one host of it). Exit status 1 if a role does
not fit, so launch scripts can check before they create anything.

With ``--compile`` (and libtpu installed: ``bash launch/setup.sh --tpu-compile``), every per-step
program of both roles is compiled by the TPU compiler for those slices, on this machine
(``asyncrl_jax.tpu.compile``): the compiler's bytes per chip beside the estimate, FLOPs, roofline
times, collectives and the projected rates; ``--json=FILE`` writes it all. Exit status 1 if a role's
largest program and its resident state do not fit a chip with the margin, 2 without libtpu."""

from __future__ import annotations

import sys

from absl import app, flags

from asyncrl_jax import cli

_CONFIG = cli.define_config_flag()


def _flatten(d, prefix=""):
  for k, v in d.items():
    if isinstance(v, dict):
      yield from _flatten(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", v


def parameters_line(m) -> str:
  """The model's size; a mixture of experts' also the parameters a token passes through."""
  line = f"model parameters: {m.num_params:,}"
  if m.moe:
    line += (f" ({m.num_active_params:,} active per token: {m.num_experts_per_tok} of {m.num_experts} "
             f"experts in {len(m.moe_layers)} of {m.num_layers} layers)")
  return line


def memory_report(config, accelerator: str, rollout_accelerator: str = "", margin: float = 0.2):
  """Lines of the per-role memory tables and verdicts, and whether every role fits."""
  from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu import chips, memory  # pylint: disable=import-outside-toplevel
  m = models.config_of(config)
  _, learner_chips = chips.parse(accelerator)
  rollout_accelerator = rollout_accelerator or accelerator
  memory.check_mesh(m, config.mesh.learner, learner_chips, "mesh.learner")
  memory.check_mesh(m, config.mesh.rollout, chips.host_chips(rollout_accelerator), "mesh.rollout")
  roles = [(memory.learner(config, m, learner_chips), accelerator),
           (memory.decode_server(config, m, chips.host_chips(rollout_accelerator)), rollout_accelerator)]
  if config.learner.eval_every:  # (on a pod the decode servers are other hosts: it runs on the learner's)
    roles.insert(1, (memory.evaluation(config, m, learner_chips), accelerator))
  lines, ok = [parameters_line(m)], True
  if not config.rollout.servers:
    lines.append("(the tables assume the pod's layout: decode servers on hosts of their own, so "
                 "held-out evaluation on the learner's chips; with rollout.servers=0 decoding and "
                 "evaluation share one host's devices with the learner, which they do not estimate)")
  for role, acc in roles:
    fits, share = memory.fits(role, acc, margin)
    ok &= fits
    lines += role.lines()
    lines.append(f"  {'fits' if fits else 'DOES NOT FIT'} one {acc} chip: {share:.0%} of its HBM "
                 f"(margin {margin:.0%})")
  return lines, ok


def _compile(config, accelerator: str, rollout_accelerator: str, margin: float, shapes: str,
             json_path: str, roles: tuple) -> int:
  """``--compile``: the report on stdout (and ``json_path``); the exit status."""
  import json  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu import compile as tpu_compile  # pylint: disable=import-outside-toplevel
  try:
    tpu_compile.require_libtpu()
  except tpu_compile.LibtpuMissing as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  try:
    report = tpu_compile.compile_config(config, accelerator, rollout_accelerator, margin=margin,
                                        shapes=shapes, roles=roles,
                                        progress=lambda line: print(line, flush=True))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for line in tpu_compile.report_lines(report):
    print(line)
  if json_path:
    with open(json_path, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
    print(f"wrote {json_path}")
  bad = [(name, r) for name, r in report["roles"].items() if not r["fits"]]
  for name, r in bad:
    refused = next((p["refused"] for p in r["programs"] if p.get("refused")), "")
    print(f"error: the {name} does not fit one {r['chip']} chip with {r['margin']:.0%} of its HBM "
          f"free: its program {r['peak_program']} needs {r['peak_bytes'] / 2**30:.2f} GiB with the "
          f"state resident beside it, of {(1 - r['margin']) * r['hbm_bytes'] / 2**30:.2f} GiB usable"
          + (f" (the TPU compiler refused it: {refused})" if refused else ""), file=sys.stderr)
  return 1 if bad else 0


def main(argv=None) -> None:
  cli.skip_absent_tpu()  # (libtpu here is for compiling: the process itself runs on the CPU)
  accelerator = flags.DEFINE_string("accelerator", "", "learner slice, e.g. v5p-32: print the memory "
                                    "estimate per device")
  rollout = flags.DEFINE_string("rollout_accelerator", "", "decode-server slice (one host of it "
                                "per server); default: the learner's")
  margin = flags.DEFINE_float("margin", 0.2, "share of HBM to keep free")
  compile_ = flags.DEFINE_bool("compile", False, "compile every per-step program with the TPU "
                               "compiler (libtpu) for --accelerator and --rollout_accelerator")
  json_path = flags.DEFINE_string("json", "", "with --compile: write the report here as JSON")
  roles = flags.DEFINE_list("roles", ["learner", "rollout"], "with --compile: the roles to compile "
                            "(learner, rollout)")
  shapes = flags.DEFINE_enum("shapes", "covering", ["covering", "all"], "with --compile: the "
                             "decode server's prefill shapes to compile: the widest per row count "
                             "(covering) or every one the engine may compile (all)")

  def _main(args):
    del args
    config = cli.validated(_CONFIG.value)
    for key, value in _flatten(config.to_dict()):
      print(f"{key}: {value}")
    ok = True
    if compile_.value:
      if not accelerator.value:
        print("error: --compile needs --accelerator (the learner's slice, e.g. v5p-32)", file=sys.stderr)
        sys.exit(2)
      sys.stdout.flush()
      sys.exit(_compile(config, accelerator.value, rollout.value, margin.value, shapes.value,
                        json_path.value, tuple(roles.value)))
    if accelerator.value:
      try:
        lines, ok = memory_report(config, accelerator.value, rollout.value, margin.value)
      except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
      print("\n".join(lines))
    else:
      from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
      print(parameters_line(models.config_of(config)))
    sys.stdout.flush()
    sys.exit(0 if ok else 1)

  app.run(_main, argv=argv, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  main()
