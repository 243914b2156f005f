"""The policy model: one decoder for the Qwen2, Llama 2 / 3.x, Qwen3 and Qwen3-MoE families, its KV
cache, and Hugging Face import/export."""

import jax

from asyncrl_jax.models.api import (abstract_params, apply_decode, apply_hidden, apply_logits,
                                    cache_layout, cache_length, count_params, decode, init_cache,
                                    init_params, logits, logits_and_routes, moe_outputs,
                                    param_shardings, serving_dtypes,
                                    serving_params)
from asyncrl_jax.models import lora
from asyncrl_jax.models.config import ModelConfig, ModelConfigError, RopeScaling, lora_fields, moe_fields
from asyncrl_jax.models.forward import (ATTENTION_KINDS, DECODE_KINDS, REMAT_POLICIES, Forward,
                                        ForwardError)
from asyncrl_jax.models.hf import (CheckpointError, config_from_hf, config_to_hf, export_hf,
                                   export_peft, load_hf, read_hf_config)
from asyncrl_jax.models.transformer import KVCache


def config_of(config) -> ModelConfig:
  """The architecture an experiment config describes, without loading weights: ``model.hf_path``'s
  ``config.json`` when set, else the ``model`` section."""
  if config.model.hf_path:
    return config_from_hf(read_hf_config(config.model.hf_path), config.model.hf_path,
                          dtype=config.model.dtype, param_dtype=config.model.param_dtype).replace(
                              **lora_fields(config.model.get("lora")), **_how(config))
  return ModelConfig.from_mapping(config.model.to_dict())


def _how(config) -> dict:
  """The fields of an experiment's ``model`` section that apply to a checkpoint's architecture too:
  how it runs, not what it computes."""
  moe = config.model.get("moe")
  return ({"moe_matmul": moe.matmul, "moe_exchange": moe.get("exchange", "padded"),
           "moe_capacity_factor": float(moe.get("capacity_factor", 0.0))} if moe is not None else {})


def from_config(config, mesh):
  """``(ModelConfig, params)`` on ``mesh``: from ``model.hf_path`` when set (architecture and weights
  in ``model.param_dtype``), else the ``model`` section's architecture, randomly initialised from
  ``seed``."""
  if config.model.hf_path:
    base_config, base = load_hf(config.model.hf_path, mesh=mesh, dtype=config.model.dtype,
                                param_dtype=config.model.param_dtype)
    model_config = base_config.replace(**lora_fields(config.model.get("lora")), **_how(config))
    return model_config, lora.add_adapters(model_config, base, jax.random.key(config.seed), mesh)
  model_config = ModelConfig.from_mapping(config.model.to_dict())
  return model_config, init_params(model_config, jax.random.key(config.seed), mesh=mesh)


__all__ = [
    "ATTENTION_KINDS", "DECODE_KINDS", "REMAT_POLICIES", "Forward", "ForwardError", "ModelConfig", "ModelConfigError",
    "CheckpointError", "KVCache", "RopeScaling", "moe_fields", "abstract_params", "apply_decode", "cache_layout", "cache_length",
    "apply_hidden", "apply_logits", "config_from_hf", "config_of", "config_to_hf", "count_params",
    "decode", "export_hf", "export_peft", "from_config",
    "init_cache", "init_params", "load_hf", "logits", "logits_and_routes", "moe_outputs",
    "param_shardings", "serving_dtypes",
    "serving_params",
]
