"""Qwen2.5-1.5B-class reasoning RL on math, on Cloud TPU v5p: a v5p-64 learner (32 chips) and 8
single-host v5p-8 decode servers (32 chips), the 1:1 split the planner picks for these 64 chips
(launch/tpu/examples/qwen2_5_1_5b_v5p.env).

  python -m asyncrl_jax.train --config=configs/qwen2_5_1_5b.py --workdir=gs://BUCKET/run \
      --config.model.hf_path=/path/to/R1-Distill-Qwen-1.5B --config.data.path=/path/to/data

Shape (Qwen2.5-1.5B): 28 layers, d=1536, 12 query / 2 kv heads (head_dim 128), SwiGLU 8960, vocab
151936. With ``model.hf_path`` set, the architecture and weights come from the checkpoint's
config.json (R1-Distill-Qwen-1.5B: untied embeddings, rope theta 1e4); the fields below document the
expected shape and serve random-weight benchmarks.

Settings and their source (AReaL, arXiv:2505.24298, and its repository's 1.5B math configs,
``examples/configs/v0.2-qwen2-math/1.5B-distill``, with the asynchronous settings of its README):
512 prompts x 16 responses per batch (``learner.batch_size`` 8192 trajectories, ``rl.group_size``
16), prompts up to 1024 tokens and completions up to 27648 (32k context), learning rate 2e-5, 4 PPO
minibatches per batch, temperature 1, decoupled PPO, eta 4 (AReaL's recommended
``max_head_offpolicyness``; its ablation is flat for eta <= 8), and 32768 tokens per micro-batch per
device (AReaL: 30720-32768 per GPU), so ``learner.token_budget`` = 32 x 32768.

Memory (``python -m asyncrl_jax info --config=configs/qwen2_5_1_5b.py --accelerator=v5p-64
--rollout_accelerator=v5p-8 --compile``: the TPU compiler's figures, docs/tpu.md): each role fits its
chips with 20% of HBM to spare: the learner's largest program needs 15.5 GiB per chip with its
resident state, a decode server's 53.4 GiB (256 slots). That takes full remat, a chunked log-softmax and the
layers as one scan (``learner.scan_layers``: unrolled, the compiler held 71.6 GiB) in the learner,
and on the decode servers blockwise prefill attention and re-prefill calls of at most 4 full-length
rows (1 per chip). Decode servers use data parallelism over their 4 chips: 2 kv heads do
not split over tensor=4.

The learner shards its weights over 16 chips and keeps two replicas (``mesh.learner`` data=2):
sharded over all 32, the compiler splits every weight-gathering matrix product into a loop of 16
steps that re-reads the activations at each (8.4 TB of HBM traffic per chip per micro-batch against
1.7 TB; decision 0048).

Decode steps read each slot's cache only up to its position (``rollout.decode_attention="ragged"``:
the Pallas paged kernel over the cache viewed as pages), so a step moves the weights and the live
keys and values rather than every position; the cache itself is still allocated in full per slot,
which 256 slots per server (64 per chip) fill to the margin's side.

Speed (the same compile, docs/tpu.md; roofline projections, not measurements): the learner's
attention is the splash TPU kernel (``learner.attention="splash"``: scores stay on chip, blocks that
pair two packed sequences are skipped), and its gradient step is compute-bound: 799k tokens/s on the
32 chips, MFU 62% (6N plus attention within sequences); a decode server 42.9k tokens/s, its step
1.38x the live-cache roofline. ``remat="full"`` is kept: "minimal" and "dots_saveable" compiled to
the same FLOPs with 36 GiB more per chip. This 32 + 32 split at eta 4 is the planner's best of these
64 chips (2.24x colocated synchronous RL).

Held-out evaluation is off (``learner.eval_every=0``, as in every config derived from this one): on
the learner's chips it would decode 256 x (1 + 4) completions of up to 27648 tokens between two
steps, 60.6 GiB per v5p chip (``info`` with ``--config.learner.eval_every=50``) and, on v6e, more
than a chip holds. Evaluate exported checkpoints with ``python -m asyncrl_jax eval`` instead.
"""

from asyncrl_jax.config import base_config

ACCELERATORS = dict(learner="v5p-64", rollout="v5p-8", margin=0.2)
LEARNER_CHIPS = 32


def get_config():
  c = base_config()
  c.steps = 1000
  c.model.update(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                 num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                 qkv_bias=True, tie_embeddings=True, max_seq_len=32768, dtype="bfloat16",
                 param_dtype="float32")
  c.data.update(task="tfds", path="~/tensorflow_datasets", max_prompt_len=1024,
                max_completion_len=27648)
  c.rollout.update(num_slots=256, temperature=1.0, top_p=1.0, attention_chunk=512,
                   decode_attention="ragged", prefill_tokens=4 * 28672)
  c.learner.update(batch_size=512 * 16, token_budget=LEARNER_CHIPS * 32768, learning_rate=2e-5,
                   warmup_steps=0, weight_decay=0.05, grad_clip=1.0, ppo_minibatches=4, remat="full",
                   vocab_chunk=8192, attention="splash", scan_layers=True, eval_every=0)
  c.rl.update(loss="decoupled_ppo", max_staleness=4, eps_clip=0.2, advantage="group", group_size=16)
  c.mesh.update(rollout_fraction=0.5)
  c.mesh.learner.update(data=2, fsdp=-1, tensor=1)  # FSDP over 16 chips, two replicas (see above)
  c.mesh.rollout.update(data=-1, fsdp=1, tensor=1)
  c.checkpoint.update(every_steps=50, max_to_keep=3, async_save=True)
  return c
