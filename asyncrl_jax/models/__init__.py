"""The policy model: a Qwen2/Llama-family decoder, its KV cache, and Hugging Face import/export."""

from asyncrl_jax.models.api import (abstract_params, apply_decode, apply_logits, count_params, decode,
                                    init_cache, init_params, logits, param_shardings)
from asyncrl_jax.models.config import ModelConfig, ModelConfigError
from asyncrl_jax.models.hf import CheckpointError, config_from_hf, config_to_hf, export_hf, load_hf
from asyncrl_jax.models.transformer import KVCache

__all__ = [
    "ModelConfig", "ModelConfigError", "CheckpointError", "KVCache", "abstract_params", "apply_decode",
    "apply_logits", "config_from_hf", "config_to_hf", "count_params", "decode", "export_hf",
    "init_cache", "init_params", "load_hf", "logits", "param_shardings",
]
