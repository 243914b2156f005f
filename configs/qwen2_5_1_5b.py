"""Qwen2.5-1.5B-class reasoning RL on math data, on Cloud TPU (launch/tpu/, with launch/tpu/examples/qwen2_5_1_5b_v5p.env).

  python -m asyncrl_jax.train --config=configs/qwen2_5_1_5b.py --workdir=gs://BUCKET/run \
      --config.model.hf_path=/path/to/Qwen2.5-1.5B-Instruct --config.data.path=/path/to/tfds

Shape (Qwen2.5-1.5B): 28 layers, d=1536, 12 query / 2 kv heads (head_dim 128), SwiGLU 8960, tied
embeddings, vocab 151936, rope theta 1e6. With ``model.hf_path`` set, the architecture and weights come
from the checkpoint's config.json and safetensors; the fields below then document the expected shape and
serve random-weight benchmarks. Objective and staleness follow AReaL's 1.5B math run (eta 8 is inside the
flat region of both the throughput and the accuracy curves; decoupled PPO).
"""

from asyncrl_jax.config import base_config


def get_config():
  c = base_config()
  c.steps = 1000
  c.model.update(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                 num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                 qkv_bias=True, tie_embeddings=True, max_seq_len=32768, dtype="bfloat16",
                 param_dtype="float32")
  c.data.update(task="tfds", path="~/tensorflow_datasets", max_prompt_len=1024,
                max_completion_len=27648)
  c.rollout.update(num_slots=128, temperature=1.0, top_p=1.0)
  c.learner.update(batch_size=512, token_budget=32768, learning_rate=2e-5, warmup_steps=10,
                   weight_decay=0.05, grad_clip=1.0, remat=True, vocab_chunk=8192)
  c.rl.update(loss="decoupled_ppo", max_staleness=8, eps_clip=0.2, advantage="group", group_size=16)
  c.mesh.update(rollout_fraction=0.75)
  c.mesh.learner.update(data=1, fsdp=-1, tensor=1)
  c.mesh.rollout.update(data=-1, fsdp=1, tensor=4)
  c.checkpoint.update(every_steps=50, max_to_keep=3, async_save=True)
  return c
