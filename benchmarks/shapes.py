"""Named model shapes for benchmarks (random weights): the CPU demo and realistic accelerator sizes."""

from __future__ import annotations

from asyncrl_jax.models.config import ModelConfig

SHAPES = {
    # the built-in CPU experiment (configs/default.py)
    "demo": dict(vocab_size=17, hidden_size=128, intermediate_size=512, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_seq_len=4096),
    # Qwen2.5-0.5B / 1.5B shapes (config.json of the published models; tied embeddings, qkv bias)
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1000000.0,
                         tie_embeddings=True, max_seq_len=32768),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                         num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1000000.0,
                         tie_embeddings=True, max_seq_len=32768),
}


def model_config(name: str, dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
  if name not in SHAPES:
    raise ValueError(f"unknown model shape {name!r}; choose from {sorted(SHAPES)}")
  return ModelConfig(**SHAPES[name], dtype=dtype, param_dtype=param_dtype)
