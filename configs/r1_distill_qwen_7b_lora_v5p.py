"""LoRA RL of R1-Distill-Qwen-7B on math, on Cloud TPU v5p, with int8 decode servers: the frozen base
and rank-64 adapters on every projection, a v5p-8 learner (4 chips: the smallest v5p slice) and
single-host v5p-8 decode servers holding the weights in int8.

  python -m asyncrl_jax.train --config=configs/r1_distill_qwen_7b_lora_v5p.py --workdir=gs://BUCKET/run \
      --config.model.hf_path=/path/to/DeepSeek-R1-Distill-Qwen-7B --config.data.path=/path/to/data

Everything else as ``configs/r1_distill_qwen_7b_v5p.py`` (batch, lengths, minibatches, eta, 32768
micro-batch tokens per learner chip). LoRA changes what the learner holds more than what it
computes: the base stays in the forward and backward passes (only its weight gradients and optimizer
state are gone: 4 instead of 6 FLOPs per base parameter and token), so a small learner slice is slower
per version, not cheaper per token. A weight update moves the adapters alone (160M parameters, 2.1% of
the weights at rank 64) after each server's first pull. The adapters' learning rate is 10x the
full-weight config's, as LoRA RL recipes use.

Memory (``python -m asyncrl_jax info --config=configs/r1_distill_qwen_7b_lora_v5p.py
--accelerator=v5p-8 --rollout_accelerator=v5p-8 --compile``: the TPU compiler's figures): each role
fits its chips with 20% of HBM to spare: the learner's largest program needs 55.0 GiB per chip with
its resident state (73.8 GiB before the base's gradients were left out of the program), a decode
server's 52.8 GiB (int8 weights: 2.0 GiB per chip instead of 3.5).

Speed (the same compile; roofline projections): learner 30.0k tokens/s on 4 chips, MFU 56% (model
FLOPs with the frozen base at 4 x); a decode server 19.4k tokens/s; 1.78x synchronous RL on these 8
chips, the planner's best split (4 + 4, eta 1).
"""

from asyncrl_jax.config import config_module

_base = config_module("r1_distill_qwen_7b_v5p.py", beside=__file__)

LEARNER_CHIPS = 4
ACCELERATORS = dict(learner=f"v5p-{2 * LEARNER_CHIPS}", rollout="v5p-8", margin=0.2)


def get_config():
  c = _base.get_config()
  c.model.lora.update(rank=64, alpha=128.0, targets="q,k,v,o,gate,up,down")
  c.learner.token_budget = LEARNER_CHIPS * 32768
  c.learner.learning_rate = 2e-4
  c.rollout.weight_dtype = "int8"
  return c
