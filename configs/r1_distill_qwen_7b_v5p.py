"""R1-Distill-Qwen-7B reasoning RL on math, on Cloud TPU v5p: a v5p-128 learner (64 chips, 16 hosts)
and 16 single-host v5p-8 decode servers (64 chips), the 1:1 split the planner picks for these 128
chips (launch/tpu/examples/r1_distill_qwen_7b_v5p.env).

  python -m asyncrl_jax.train --config=configs/r1_distill_qwen_7b_v5p.py --workdir=gs://BUCKET/run \
      --config.model.hf_path=/path/to/DeepSeek-R1-Distill-Qwen-7B --config.data.path=/path/to/data

Shape (R1-Distill-Qwen-7B): 28 layers, d=3584, 28 query / 4 kv heads (head_dim 128), SwiGLU 18944,
vocab 152064, untied embeddings, rope theta 1e4; the checkpoint's config.json decides when
``model.hf_path`` is set. Batch, lengths, learning rate, minibatches, eta and micro-batch tokens per
device as in ``configs/qwen2_5_1_5b.py`` (AReaL's 7B math configs,
``examples/configs/v0.2-qwen2-math/7B-distill``, use the same values). Decode servers split the
model over their 4 chips (tensor=4: 28 query and 4 kv heads both divide).

Memory (``python -m asyncrl_jax info --config=configs/r1_distill_qwen_7b_v5p.py
--accelerator=v5p-128 --rollout_accelerator=v5p-8 --compile``: the TPU compiler's figures,
docs/tpu.md): each role fits its chips with 20% of HBM to spare: the learner's largest program
needs 31.5 GiB per chip with its resident state, a decode server's 53.8 GiB.

Speed (the same compile; roofline projections): learner 398k tokens/s on 64 chips, MFU 64% (over
all 64 chips the compiler gathers no weights in loops: it all-reduces partial products instead);
a decode server 18.0k tokens/s (1.55x its live-cache roofline); 3.29x synchronous RL on separate
slices, the planner's best split of these 128 chips.
"""

from asyncrl_jax.config import config_module

_base = config_module("qwen2_5_1_5b.py", beside=__file__)

ACCELERATORS = dict(learner="v5p-128", rollout="v5p-8", margin=0.2)


def get_config():
  c = _base.get_config()
  c.model.update(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                 num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e4, tie_embeddings=False,
                 max_seq_len=32768)
  c.learner.token_budget = 64 * 32768  # 64 learner chips, 32768 tokens each
  c.mesh.rollout.update(data=1, fsdp=1, tensor=4)
  c.mesh.learner.update(data=1, fsdp=-1, tensor=1)  # FSDP over all 64 chips (no replicas: see above)
  c.rollout.prefill_tokens = 1 * 28672  # full-length rows one at a time (each split over 4 chips)
  c.rollout.num_slots = 128  # the 7B cache fills a v5p chip's margin at 128 slots per server
  return c
