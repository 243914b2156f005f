"""Qwen3-30B-A3B (mixture of experts) reasoning RL on math, on Cloud TPU v5p, expert parallel: a
v5p-64 learner (32 chips, 8 hosts) and 8 single-host v5p-8 decode servers (32 chips)
(launch/tpu/examples/qwen3_30b_a3b_v5p.env).

  python -m asyncrl_jax.train --config=configs/qwen3_30b_a3b_v5p.py --workdir=gs://BUCKET/run \
      --config.model.hf_path=/path/to/Qwen3-30B-A3B --config.data.tokenizer_path=/path/to/Qwen3-30B-A3B \
      --config.data.path=/path/to/data

Shape (Qwen3-30B-A3B, the hub's config.json): 48 layers, d=2048, 32 query / 4 kv heads (head_dim
128), every layer's MLP a mixture of 128 experts of SwiGLU width 768 with 8 routed per token
(``norm_topk_prob``), vocab 151936, untied embeddings, rope theta 1e6, q/k RMSNorm, no q/k/v bias:
30.5B parameters, 3.3B active per token. Given inline so that the programs compile without the
weights; the checkpoint's config.json decides when ``model.hf_path`` is set.

Mixture of experts: each decode server records every token's 8 experts per layer (int16, 768 bytes
per token) and the learner replays them (``rollout.record_routes``, ``rl.replay_routes``: routing
replay); the objective is GSPO (``rl.loss=gspo``, the Qwen team's for MoE RL) with the load-balancing
loss at 0.001. Experts run grouped by the megablox kernel (``model.moe.matmul``) and travel between
expert shards by ``ragged_all_to_all`` (``model.moe.exchange``), each shard sending at most 1.25x its
even share of routing slots to each expert shard (``model.moe.capacity_factor``; the rest dropped and
logged as ``moe_dropped_frac``: raise the factor, or set 0 for dropless, if it is not near 0).

Meshes: the learner splits the 128 experts over 8 shards (``expert=8``) and everything over 4 more
(``fsdp=4``): an expert's weights and AdamW moments live on one of 32 chips, the attention and
embeddings (1.5B parameters) on 4 (replicated over the expert axis, which is data-parallel for
them). A decode server splits the experts over its 4 chips (``expert=4``, slots over them too).

Lengths are this family's RL runs' 16k (prompt 1024 + completion 15360) rather than the 8B config's
32k: one 16k row per learner chip.

Memory: each role fits its chips with 20% of HBM to spare by the estimate (``info``: 44.2 GiB per
learner chip and 56.1 GiB per decode chip with the capacity factor; 59.4 and 61.8 dropless). The TPU compiler has so far
seen only the dropless form, in a compile stopped before it finished
(benchmarks/results/tpu_compile/qwen3_30b_a3b_v5p.partial.md: the learner's 5 programs and 3 of the
decode server's 11): its learner gradient step needed 75.4 GiB per chip with its resident state (79%
of a v5p chip's 95 GiB; the estimate missed 16 GiB of it), its decode chunk 72.1 GiB at 96 slots
(78.5 GiB at 128, past the margin, hence 96), and the gradient step's roofline was bytes-bound at
about 7% of peak on active parameters: dropless expert parallelism sizes each shard's receive buffer
for the worst case (expert x k = 64 rows per local token, gathered and scattered in every MoE layer),
which the capacity factor cuts to 1.25 x 8 = 10.
"""

from asyncrl_jax.config import config_module

_base = config_module("qwen2_5_1_5b.py", beside=__file__)

LEARNER_CHIPS = 32
ACCELERATORS = dict(learner="v5p-64", rollout="v5p-8", margin=0.2)
LENGTH = 16384


def get_config():
  c = _base.get_config()
  c.model.update(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                 num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                 qkv_bias=False, qk_norm=True, tie_embeddings=False, max_seq_len=LENGTH)
  c.model.moe.update(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True,
                     matmul="megablox", exchange="ragged", capacity_factor=1.25, aux_loss_coef=0.001)
  c.data.update(max_prompt_len=1024, max_completion_len=LENGTH - 1024)
  c.rollout.record_routes = True
  c.rl.update(loss="gspo", replay_routes=True, aggregation="sequence_mean")
  c.learner.token_budget = LEARNER_CHIPS * LENGTH  # one full-length row per learner chip
  c.mesh.learner.update(data=1, fsdp=4, expert=8, tensor=1)
  c.mesh.rollout.update(data=1, fsdp=1, expert=4, tensor=1)
  c.rollout.prefill_tokens = 4 * (LENGTH - 1024)  # a full-length row per chip per call
  c.rollout.num_slots = 96  # (128 compiled to 78.5 GiB per chip in the decode chunk: past the margin)
  return c
