"""RL that must go beyond its demonstrations: long addition chains with demonstrations of short ones only.

  python -m asyncrl_jax.train --config=configs/long_chains.py --workdir=/tmp/long_chains
  .venv/bin/python benchmarks/rl_vs_rft.py      # RL beside rejection-sampling fine-tuning, same time

The supervised warm start sees worked solutions of chains of 2-4 terms only (``data.demo_max_terms``);
RL trains on prompts of 5-10 terms and is evaluated on held-out chains of 5-10 terms, for which no
demonstration exists. The honest control is rejection-sampling fine-tuning on the same prompts for the
same wall time (``python -m asyncrl_jax.sft --rft``, ``benchmarks/rl_vs_rft.py``). Everything else is
configs/default.py (value advantages, SAO's single rollout: ``--config.rl.advantage=value
--config.rl.group_size=1 --config.rl.loss=dis``). Results: benchmarks/RESULTS.md (rl_vs_rft).
"""

from asyncrl_jax.config import config_module

_default = config_module("default.py", beside=__file__)


def get_config():
  c = _default.get_config()
  c.data.update(min_terms=5, max_terms=10, demo_max_terms=4)
  # no KL term towards the starting policy: it is right on 2.5% of these chains, and RL must go beyond
  # it (docs/decisions/0055)
  c.rl.kl_coef = 0.0
  return c
