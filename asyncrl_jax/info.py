"""``python -m asyncrl_jax.info --config=configs/x.py [--accelerator=v5p-32 --rollout_accelerator=v5p-8]``:
the validated config and the model size; with an accelerator, the memory estimate per device of each
role (``asyncrl_jax.memory``) and whether it fits one chip's HBM with ``--margin`` to spare.

The learner spans every chip of ``--accelerator``; each decode server is one host of
``--rollout_accelerator`` (default: the learner's type, one host of it). Exit status 1 if a role does
not fit, so launch scripts can check before they create anything."""

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


def memory_report(config, accelerator: str, rollout_accelerator: str = "", margin: float = 0.2):
  """Lines of the per-role memory tables and verdicts, and whether every role fits."""
  from asyncrl_jax import memory, models  # pylint: disable=import-outside-toplevel
  m = models.config_of(config)
  _, learner_chips = memory.chips(accelerator)
  rollout_accelerator = rollout_accelerator or accelerator
  roles = [(memory.learner(config, m, learner_chips), accelerator),
           (memory.decode_server(config, m, memory.host_chips(rollout_accelerator)), rollout_accelerator)]
  if config.learner.eval_every:  # (on a pod the decode servers are other hosts: it runs on the learner's)
    roles.insert(1, (memory.evaluation(config, m, learner_chips), accelerator))
  lines, ok = [f"model parameters: {m.num_params:,}"], True
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


def main(argv=None) -> None:
  accelerator = flags.DEFINE_string("accelerator", "", "learner slice, e.g. v5p-32: print the memory "
                                    "estimate per device")
  rollout = flags.DEFINE_string("rollout_accelerator", "", "decode-server slice (one host of it "
                                "per server); default: the learner's")
  margin = flags.DEFINE_float("margin", 0.2, "share of HBM to keep free")

  def _main(args):
    del args
    config = cli.validated(_CONFIG.value)
    for key, value in _flatten(config.to_dict()):
      print(f"{key}: {value}")
    ok = True
    if accelerator.value:
      lines, ok = memory_report(config, accelerator.value, rollout.value, margin.value)
      print("\n".join(lines))
    elif not config.model.hf_path:
      from asyncrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
      print(f"model parameters: {config_lib.model_config(config).num_params:,}")
    sys.stdout.flush()
    sys.exit(0 if ok else 1)

  app.run(_main, argv=argv, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  main()
