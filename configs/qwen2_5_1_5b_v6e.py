"""The Qwen2.5-1.5B math run of ``configs/qwen2_5_1_5b.py`` on Cloud TPU v6e: a v6e-16 learner (16
chips, 4 hosts) and 6 single-host v6e-8 decode servers (48 chips), the 3:1 rollout:learner split.

Same objective, batch (512 prompts x 16 responses, AReaL), lengths, eta and per-device micro-batch as
the v5p config. A v6e chip has 32 GiB of HBM, a third of a v5p chip's, so each decode server spreads
its 128 slots over 8 chips (16 per chip). Memory (``python -m asyncrl_jax info
--config=configs/qwen2_5_1_5b_v6e.py --accelerator=v6e-16 --rollout_accelerator=v6e-8 --compile``:
the TPU compiler's figures, docs/tpu.md): each role fits its chips with 20% of HBM to spare: the
learner's largest program needs 18.6 GiB per chip with its resident state, a decode server's 16.6
GiB of 32. The learner keeps two replicas of 8-chip FSDP (``mesh.learner`` data=2): over all 16 the
compiler loops over the shards and re-reads activations (MFU 12.2% against 47.1%, decision 0048).
"""

from asyncrl_jax.config import config_module

_base = config_module("qwen2_5_1_5b.py", beside=__file__)

ACCELERATORS = dict(learner="v6e-16", rollout="v6e-8", margin=0.2)


def get_config():
  c = _base.get_config()
  c.learner.token_budget = 16 * 32768  # 16 learner chips, 32768 tokens each
  c.rollout.prefill_tokens = 8 * 28672  # one full-length row per chip of a server
  c.rollout.num_slots = 128  # 16 per chip: a v6e chip holds a third of a v5p chip's cache
  c.mesh.learner.update(data=2, fsdp=-1, tensor=1)  # FSDP over 8 chips, two replicas (decision 0048)
  c.mesh.rollout_fraction = 0.75  # the planner's best split of these 64 v6e chips (16 + 48)
  return c
