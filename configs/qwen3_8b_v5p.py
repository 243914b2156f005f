"""Qwen3-8B reasoning RL on math, on Cloud TPU v5p: a v5p-64 learner (32 chips, 8 hosts) and 8
single-host v5p-8 decode servers (32 chips) (launch/tpu/examples/qwen3_8b_v5p.env).

  python -m asyncrl_jax.train --config=configs/qwen3_8b_v5p.py --workdir=gs://BUCKET/run \
      --config.model.hf_path=/path/to/Qwen3-8B --config.data.tokenizer_path=/path/to/Qwen3-8B \
      --config.data.path=/path/to/data

Shape (Qwen3-8B, the hub's config.json): 36 layers, d=4096, 32 query / 8 kv heads (head_dim 128),
SwiGLU 12288, vocab 151936, untied embeddings, rope theta 1e6 without scaling, RMSNorm eps 1e-6,
an RMSNorm on each query and key head before RoPE (``model.qk_norm``) and no q/k/v bias: 8.19B
parameters. Given inline so that the programs compile without the weights; the checkpoint's
config.json decides when ``model.hf_path`` is set. ``model.max_seq_len`` is the runs' 32768 (prompt
+ completion: 28672), not the hub's 40960. Prompts go through the tokenizer directory's chat
template (``data.tokenizer_path``: Qwen3's own, rendered without ``enable_thinking=False``, so each
completion opens with the model's <think> section before its answer). Batch, lengths, learning rate,
minibatches, eta and micro-batch tokens per device as in ``configs/qwen2_5_1_5b.py`` (AReaL's math
configs). Decode servers split the model over their 4 chips (tensor=4: 32 query and 8 kv heads both
divide); a slot's full-length KV cache is 4.2 GB (2.6x the R1-Distill-Qwen-7B's: 36 layers x 8 kv
heads against 28 x 4), so a server holds 64 slots where the 7B config holds 128.

Memory (``python -m asyncrl_jax info --config=configs/qwen3_8b_v5p.py --accelerator=v5p-64
--rollout_accelerator=v5p-8 --compile``: the TPU compiler's figures, docs/tpu.md): each role fits its
chips with 20% of HBM to spare: the learner's largest program needs 50.8 GiB per chip with its
resident state, a decode server's 68.0 GiB (a full-length re-prefill; the 64 slots' cache is 63 GiB
of it).

The learner shards its weights over 16 chips and keeps two replicas (``mesh.learner`` data=2, as the
1.5B config; decision 0048): over all 32 chips the compiler splits every weight-gathering product
into a loop over the shards (37,570 collective-permutes, 18.7 TB of HBM traffic per chip per
micro-batch against 5.3 TB, MFU 37.7% against 63.1%, 50.6 GiB per chip).

Speed (the same compile; roofline projections, not measurements): learner 176k tokens/s on 32 chips,
MFU 63.1% (compute-bound); a decode server 7.4k tokens/s (1.55x its live-cache roofline); 1.77x
synchronous RL on separate slices at this 32 + 32 split, where the decode servers are the bottleneck
(the learner idles 62% of the time). The planner's best split of these 64 chips is a 16-chip learner
(v5p-32) and 48 decode chips (12 v5p-8 servers) at eta 2 or 4: 2.20x (70k against 57k tokens/s);
that split is not compiled here (its learner would run ``learner.token_budget=16 * 32768``).
"""

from asyncrl_jax.config import config_module

_base = config_module("qwen2_5_1_5b.py", beside=__file__)

LEARNER_CHIPS = 32
ACCELERATORS = dict(learner="v5p-64", rollout="v5p-8", margin=0.2)


def get_config():
  c = _base.get_config()
  c.model.update(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                 num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                 qkv_bias=False, qk_norm=True, tie_embeddings=False, max_seq_len=32768)
  c.learner.token_budget = LEARNER_CHIPS * 32768  # 32768 tokens per learner chip
  c.mesh.learner.update(data=2, fsdp=-1, tensor=1)  # FSDP over 16 chips, two replicas (see above)
  c.mesh.rollout.update(data=1, fsdp=1, tensor=4)
  c.rollout.prefill_tokens = 1 * 28672  # full-length rows one at a time (each split over 4 chips)
  c.rollout.num_slots = 64  # the 8B's cache fills a v5p chip's margin at 64 slots per server
  return c
