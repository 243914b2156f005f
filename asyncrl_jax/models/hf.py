"""Hugging Face checkpoint directories (config.json + *.safetensors) <-> our params.

Supported architectures (``model_type``):

* ``qwen2`` (``Qwen2ForCausalLM``): q/k/v bias;
* ``llama`` (``LlamaForCausalLM``; Llama 2, 3, 3.1-3.3): rope scaling of type ``llama3``;
* ``qwen3`` (``Qwen3ForCausalLM``): per-head q/k RMSNorm, no bias, rope scaling ``yarn``;
* ``qwen3_moe`` (``Qwen3MoeForCausalLM``): Qwen3's attention, mixture-of-experts MLPs
  (``num_experts`` or transformers 5's ``num_local_experts``, ``num_experts_per_tok``,
  ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``).

The RoPE settings are read from the hub's ``rope_theta`` + ``rope_scaling`` or transformers 5's
``rope_parameters``. Anything else (other families such as Gemma 3 or DeepSeek-V3, sliding-window
layers, rope types other than ``llama3`` and ``yarn``, MLP or output-projection biases) is refused with
an error that names the field rather than loaded approximately.

Weight layout (HF stores ``Linear`` weights as ``[out, in]``):

====================================  ===============================  ============================
HF tensor                             ours                             transform
====================================  ===============================  ============================
model.embed_tokens.weight [V, D]      embed [V, D]                     --
...self_attn.q_proj.weight [N*H, D]   layer_i.attn.q [D, N, H]         W.T.reshape(D, N, H)
...self_attn.k_proj / v_proj          layer_i.attn.k / v [D, K, H]     W.T.reshape(D, K, H)
...self_attn.{q,k,v}_proj.bias        layer_i.attn.{q,k,v}_bias        reshape(N|K, H)
...self_attn.o_proj.weight [D, N*H]   layer_i.attn.o [N, H, D]         W.T.reshape(N, H, D)
...mlp.{gate,up}_proj.weight [F, D]   layer_i.mlp.{gate,up} [D, F]     W.T
...mlp.down_proj.weight [D, F]        layer_i.mlp.down [F, D]          W.T
...input_layernorm.weight             layer_i.attn_norm.scale          --
...post_attention_layernorm.weight    layer_i.mlp_norm.scale           --
model.norm.weight                     final_norm.scale                 --
lm_head.weight [V, D] (untied only)   lm_head [D, V]                   W.T
...self_attn.{q,k}_norm.weight [H]    layer_i.attn.{q,k}_norm.scale    -- (Qwen3)
...mlp.gate.weight [E, D]             layer_i.mlp.router [D, E]        W.T (MoE layers)
...mlp.experts.{e}.{gate,up}_proj     layer_i.mlp.experts_{gate,up}    stacked W.T: [E, D, F]
...mlp.experts.{e}.down_proj          layer_i.mlp.experts_down         stacked W.T: [E, F, D]
====================================  ===============================  ============================
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh

from asyncrl_jax.models import api, safetensors_io
from asyncrl_jax.models import lora
from asyncrl_jax.models.config import ModelConfig, ModelConfigError, RopeScaling

_SUPPORTED = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM"}
# the rope types each family's checkpoints use that we compute exactly (models.rope)
_ROPE_TYPES = {"qwen2": ("default",), "llama": ("default", "llama3"), "qwen3": ("default", "yarn"),
               "qwen3_moe": ("default", "yarn")}
_ROPE_KEYS = {"default": (), "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
                                        "high_freq_factor"),
              "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                       "attention_factor", "mscale", "mscale_all_dim", "truncate")}


class CheckpointError(ValueError):
  """A checkpoint directory is missing files or holds something we cannot load exactly."""


def _rope(hf: dict, path: str, model_type: str) -> tuple[float, RopeScaling]:
  """``(rope_theta, RopeScaling)`` from the hub's ``rope_theta`` + ``rope_scaling`` or transformers
  5's ``rope_parameters``; refuses a type or a key it would not compute exactly, by name."""
  params = dict(hf.get("rope_parameters") or {})
  if any(isinstance(v, dict) for v in params.values()):
    raise CheckpointError(f"{path}/config.json: rope_parameters per layer type ({sorted(params)}) are not "
                          "supported")
  params.update(hf.get("rope_scaling") or {})
  theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
  rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
  params.pop("type", None)
  if params.pop("partial_rotary_factor", 1.0) != 1.0:
    raise CheckpointError(f"{path}/config.json: partial_rotary_factor != 1 is not supported")
  allowed = _ROPE_TYPES[model_type]
  if rope_type not in allowed:
    raise CheckpointError(f"{path}/config.json: rope scaling of type {rope_type!r} is not supported for "
                          f"model_type={model_type!r}; supported: {list(allowed)}")
  unknown = sorted(k for k in params if k not in _ROPE_KEYS[rope_type])
  if unknown:
    raise CheckpointError(f"{path}/config.json: rope scaling {rope_type!r} field(s) {unknown} are not "
                          "supported")
  if rope_type == "default":
    return theta, RopeScaling()
  fields = {k: v for k, v in params.items() if v is not None}
  if rope_type == "yarn":
    # as transformers: the pre-training context defaults to max_position_embeddings
    fields.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if "factor" not in fields:
      raise CheckpointError(f"{path}/config.json: rope scaling 'yarn' without a factor is not supported")
  missing = [k for k in ("factor", "original_max_position_embeddings") + (
      ("low_freq_factor", "high_freq_factor") if rope_type == "llama3" else ()) if fields.get(k) is None]
  if missing:
    raise CheckpointError(f"{path}/config.json: rope scaling {rope_type!r} is missing {missing}")
  try:
    scaling = RopeScaling(rope_type=rope_type, **{
        k: (int(v) if k == "original_max_position_embeddings" else bool(v) if k == "truncate"
            else float(v)) for k, v in fields.items()})
    scaling.validate()
  except (ModelConfigError, TypeError, ValueError) as e:
    raise CheckpointError(f"{path}/config.json: rope scaling: {e}") from None
  return theta, scaling


def _moe_fields(hf: dict, path: str) -> dict:
  experts = hf.get("num_experts", hf.get("num_local_experts"))
  required = {"num_experts": experts, "num_experts_per_tok": hf.get("num_experts_per_tok"),
              "moe_intermediate_size": hf.get("moe_intermediate_size")}
  missing = [k for k, v in required.items() if v is None]
  if missing:
    raise CheckpointError(f"{path}/config.json: model_type='qwen3_moe' is missing {missing}")
  if hf.get("shared_expert_intermediate_size"):
    raise CheckpointError(f"{path}/config.json: shared experts (shared_expert_intermediate_size) are not "
                          "supported")
  return {"num_experts": int(experts), "num_experts_per_tok": int(hf["num_experts_per_tok"]),
          "moe_intermediate_size": int(hf["moe_intermediate_size"]),
          "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
          "decoder_sparse_step": int(hf.get("decoder_sparse_step", 1)),
          "mlp_only_layers": tuple(int(i) for i in hf.get("mlp_only_layers") or ())}


def config_from_hf(hf: dict, path: str = "<config>", *, max_seq_len: Optional[int] = None,
                   dtype: str = "float32", param_dtype: Optional[str] = None) -> ModelConfig:
  """Translates a Hugging Face config.json dict into a ModelConfig (strictly), computing in ``dtype``
  and storing parameters in ``param_dtype`` (default: ``dtype``)."""
  model_type = hf.get("model_type")
  if model_type not in _SUPPORTED:
    raise CheckpointError(f"{path}/config.json: model_type={model_type!r} is not supported; "
                          f"supported: {sorted(_SUPPORTED)}")
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{path}/config.json: hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU)")
  if hf.get("use_sliding_window"):
    raise CheckpointError(f"{path}/config.json: use_sliding_window=true is not supported")
  sliding = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
  if sliding:
    raise CheckpointError(f"{path}/config.json: layer_types {sliding} (sliding-window layers) are not "
                          "supported; only 'full_attention'")
  if hf.get("mlp_bias"):
    raise CheckpointError(f"{path}/config.json: mlp_bias=true is not supported")
  if model_type != "qwen2" and hf.get("attention_bias"):
    raise CheckpointError(f"{path}/config.json: {model_type} attention_bias=true is not supported")
  required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") + (
      ("intermediate_size",) if model_type != "qwen3_moe" else ())
  missing = [k for k in required if k not in hf]
  if missing:
    raise CheckpointError(f"{path}/config.json: missing required fields {missing}")
  theta, scaling = _rope(hf, path, model_type)
  moe = _moe_fields(hf, path) if model_type == "qwen3_moe" else {}
  try:
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        # a Qwen3-MoE checkpoint whose every layer is sparse may leave the dense width unset
        intermediate_size=int(hf.get("intermediate_size") or moe.get("moe_intermediate_size")),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        head_dim=int(hf.get("head_dim") or 0),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(max_seq_len or hf.get("max_position_embeddings", 2048)),
        dtype=dtype,
        param_dtype=param_dtype or dtype,
        **moe,
    )
  except ModelConfigError as e:
    raise CheckpointError(f"{path}/config.json: {e}") from None


def model_type_of(config: ModelConfig) -> str:
  """The Hugging Face ``model_type`` a config exports as."""
  if config.moe:
    if not config.qk_norm or config.qkv_bias:
      raise CheckpointError("a mixture-of-experts model exports as qwen3_moe, which needs "
                            "model.qk_norm=True and model.qkv_bias=False")
    return "qwen3_moe"
  if config.qk_norm:
    if config.qkv_bias:
      raise CheckpointError("model.qk_norm=True with model.qkv_bias=True is no Hugging Face family")
    return "qwen3"
  return "qwen2" if config.qkv_bias else "llama"


def _rope_to_hf(config: ModelConfig) -> dict:
  s = config.rope_scaling
  if s.rope_type == "default":
    return {}
  fields = {"rope_type": s.rope_type, "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}
  if s.rope_type == "llama3":
    fields.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
  else:
    fields.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
      if getattr(s, name):
        fields[name] = getattr(s, name)
  return fields


def config_to_hf(config: ModelConfig) -> dict:
  """The config.json dict for a ModelConfig (``model_type_of``: qwen3_moe, qwen3, qwen2 or llama),
  with the RoPE settings both as the hub writes them (``rope_theta``, ``rope_scaling``) and as
  transformers 5 does (``rope_parameters``)."""
  model_type = model_type_of(config)
  scaling = _rope_to_hf(config)
  out = {
      "architectures": [_SUPPORTED[model_type]],
      "model_type": model_type,
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": config.max_seq_len,
      "rms_norm_eps": config.rms_norm_eps,
      "rope_theta": config.rope_theta,
      "rope_scaling": scaling or None,
      "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default", **scaling},
      "tie_word_embeddings": config.tie_embeddings,
      "torch_dtype": config.param_dtype,
      "dtype": config.param_dtype,
  }
  if model_type == "llama":
    out.update(attention_bias=False, mlp_bias=False)
  else:
    out["use_sliding_window"] = False
  if model_type in ("qwen3", "qwen3_moe"):
    out["attention_bias"] = False
  if model_type == "qwen3_moe":
    out.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
               moe_intermediate_size=config.moe_intermediate_size,
               norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=config.decoder_sparse_step,
               mlp_only_layers=list(config.mlp_only_layers))
  return out


def _expected_hf_shapes(c: ModelConfig) -> dict[str, tuple]:
  d, f, n, k, h = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
  shapes = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
  for i in range(c.num_layers):
    p = f"model.layers.{i}."
    shapes.update({
        p + "self_attn.q_proj.weight": (n * h, d), p + "self_attn.k_proj.weight": (k * h, d),
        p + "self_attn.v_proj.weight": (k * h, d), p + "self_attn.o_proj.weight": (d, n * h),
        p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    if c.is_moe_layer(i):
      e, fe = c.num_experts, c.moe_intermediate_size
      shapes[p + "mlp.gate.weight"] = (e, d)
      for j in range(e):
        shapes.update({f"{p}mlp.experts.{j}.gate_proj.weight": (fe, d),
                       f"{p}mlp.experts.{j}.up_proj.weight": (fe, d),
                       f"{p}mlp.experts.{j}.down_proj.weight": (d, fe)})
    else:
      shapes.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                     p + "mlp.down_proj.weight": (d, f)})
    if c.qk_norm:
      shapes.update({p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,)})
    if c.qkv_bias:
      shapes.update({p + "self_attn.q_proj.bias": (n * h,), p + "self_attn.k_proj.bias": (k * h,),
                     p + "self_attn.v_proj.bias": (k * h,)})
  if not c.tie_embeddings:
    shapes["lm_head.weight"] = (c.vocab_size, d)
  return shapes


def _safetensor_files(path: str) -> list[str]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise CheckpointError(f"{index}: malformed index ({e!r})") from None
    files = sorted(set(weight_map.values()))
    for name in files:
      if not os.path.exists(os.path.join(path, name)):
        raise CheckpointError(f"{index} lists {name!r}, which is not in {path}")
    return [os.path.join(path, name) for name in files]
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise CheckpointError(f"{path}: no *.safetensors files (only safetensors checkpoints are supported)")
  return files


def read_hf_config(path: str) -> dict:
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: not a directory")
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise CheckpointError(f"{path}: missing config.json")
  try:
    with open(cfg_path) as f:
      hf = json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
  if not isinstance(hf, dict):
    raise CheckpointError(f"{cfg_path}: expected a JSON object")
  return hf


def hf_to_params(config: ModelConfig, tensors: dict[str, np.ndarray], path: str = "<tensors>"
                 ) -> dict[str, Any]:
  """Converts a flat HF tensor dict to our (numpy) params, checking names and shapes exactly."""
  expected = _expected_hf_shapes(config)
  ignorable = lambda name: name.endswith("rotary_emb.inv_freq")
  if config.tie_embeddings:
    # Some tied checkpoints still store lm_head.weight; accept it only if it equals the embedding.
    head = tensors.get("lm_head.weight")
    if head is not None and not np.array_equal(head, tensors.get("model.embed_tokens.weight")):
      raise CheckpointError(f"{path}: tie_word_embeddings=true but lm_head.weight differs from the "
                            "embedding")
    ignorable = lambda name, _f=ignorable: _f(name) or name == "lm_head.weight"
  missing = sorted(set(expected) - set(tensors))
  unexpected = sorted(n for n in set(tensors) - set(expected) if not ignorable(n))
  if missing:
    raise CheckpointError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
  if unexpected:
    raise CheckpointError(f"{path}: unexpected tensors {unexpected[:5]} (unsupported architecture "
                          "variant?)")
  for name, shape in expected.items():
    if tuple(tensors[name].shape) != shape:
      raise CheckpointError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                            f"config.json implies {shape}")
  dt = np.dtype(jax.numpy.dtype(config.param_dtype))
  get = lambda name: np.asarray(tensors[name]).astype(dt)
  d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
  params: dict[str, Any] = {"embed": get("model.embed_tokens.weight"),
                            "final_norm": {"scale": get("model.norm.weight")}}
  for i in range(config.num_layers):
    p = f"model.layers.{i}."
    attn = {"q": get(p + "self_attn.q_proj.weight").T.reshape(d, n, h),
            "k": get(p + "self_attn.k_proj.weight").T.reshape(d, k, h),
            "v": get(p + "self_attn.v_proj.weight").T.reshape(d, k, h),
            "o": get(p + "self_attn.o_proj.weight").T.reshape(n, h, d)}
    if config.qkv_bias:
      attn.update(q_bias=get(p + "self_attn.q_proj.bias").reshape(n, h),
                  k_bias=get(p + "self_attn.k_proj.bias").reshape(k, h),
                  v_bias=get(p + "self_attn.v_proj.bias").reshape(k, h))
    if config.qk_norm:
      attn.update(q_norm={"scale": get(p + "self_attn.q_norm.weight")},
                  k_norm={"scale": get(p + "self_attn.k_norm.weight")})
    if config.is_moe_layer(i):
      experts = lambda proj, _p=p: np.stack([get(f"{_p}mlp.experts.{j}.{proj}_proj.weight").T
                                             for j in range(config.num_experts)])
      mlp = {"router": get(p + "mlp.gate.weight").T, "experts_gate": experts("gate"),
             "experts_up": experts("up"), "experts_down": experts("down")}
    else:
      mlp = {"gate": get(p + "mlp.gate_proj.weight").T, "up": get(p + "mlp.up_proj.weight").T,
             "down": get(p + "mlp.down_proj.weight").T}
    params[f"layer_{i}"] = {
        "attn": attn,
        "attn_norm": {"scale": get(p + "input_layernorm.weight")},
        "mlp": mlp,
        "mlp_norm": {"scale": get(p + "post_attention_layernorm.weight")},
    }
  if not config.tie_embeddings:
    params["lm_head"] = get("lm_head.weight").T
  return params


def params_to_hf(config: ModelConfig, params: dict[str, Any], dtype: Optional[str] = None
                 ) -> dict[str, np.ndarray]:
  """Inverse of ``hf_to_params``: a flat HF tensor dict (host numpy arrays)."""
  dt = np.dtype(jax.numpy.dtype(dtype or config.param_dtype))
  host = jax.tree.map(lambda x: np.asarray(jax.device_get(x)).astype(dt), params)
  d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
  out = {"model.embed_tokens.weight": host["embed"], "model.norm.weight": host["final_norm"]["scale"]}
  for i in range(config.num_layers):
    p, layer = f"model.layers.{i}.", host[f"layer_{i}"]
    attn = layer["attn"]
    out.update({
        p + "self_attn.q_proj.weight": attn["q"].reshape(d, n * h).T,
        p + "self_attn.k_proj.weight": attn["k"].reshape(d, k * h).T,
        p + "self_attn.v_proj.weight": attn["v"].reshape(d, k * h).T,
        p + "self_attn.o_proj.weight": attn["o"].reshape(n * h, d).T,
        p + "input_layernorm.weight": layer["attn_norm"]["scale"],
        p + "post_attention_layernorm.weight": layer["mlp_norm"]["scale"],
    })
    mlp = layer["mlp"]
    if config.is_moe_layer(i):
      out[p + "mlp.gate.weight"] = np.ascontiguousarray(mlp["router"].T)
      for j in range(config.num_experts):
        for proj in ("gate", "up", "down"):
          out[f"{p}mlp.experts.{j}.{proj}_proj.weight"] = np.ascontiguousarray(mlp[f"experts_{proj}"][j].T)
    else:
      out.update({p + "mlp.gate_proj.weight": mlp["gate"].T, p + "mlp.up_proj.weight": mlp["up"].T,
                  p + "mlp.down_proj.weight": mlp["down"].T})
    if config.qk_norm:
      out.update({p + "self_attn.q_norm.weight": attn["q_norm"]["scale"],
                  p + "self_attn.k_norm.weight": attn["k_norm"]["scale"]})
    if config.qkv_bias:
      out.update({p + "self_attn.q_proj.bias": attn["q_bias"].reshape(n * h),
                  p + "self_attn.k_proj.bias": attn["k_bias"].reshape(k * h),
                  p + "self_attn.v_proj.bias": attn["v_bias"].reshape(k * h)})
  if not config.tie_embeddings:
    out["lm_head.weight"] = host["lm_head"].T
  return out


def load_hf(path: str, *, mesh: Optional[Mesh] = None, dtype: str = "float32",
            max_seq_len: Optional[int] = None,
            param_dtype: Optional[str] = None) -> tuple[ModelConfig, dict[str, Any]]:
  """Loads a Hugging Face model directory into ``(config, params)``.

  Args:
    path: directory with config.json and model.safetensors (or a sharded index).
    mesh: when given, each parameter is placed straight onto this mesh with the learner sharding.
    dtype: activation dtype of the returned model (and its parameters', unless ``param_dtype``).
    max_seq_len: overrides ``max_position_embeddings``.
    param_dtype: storage dtype of the parameters.
  """
  config = config_from_hf(read_hf_config(path), path, max_seq_len=max_seq_len, dtype=dtype,
                          param_dtype=param_dtype)
  tensors: dict[str, np.ndarray] = {}
  for file in _safetensor_files(path):
    try:
      part = safetensors_io.load(file)
    except safetensors_io.SafetensorsError as e:
      raise CheckpointError(str(e)) from None
    duplicated = set(part) & set(tensors)
    if duplicated:
      raise CheckpointError(f"{file}: tensors {sorted(duplicated)[:3]} also appear in another file")
    tensors.update(part)
  params = hf_to_params(config, tensors, path)
  if mesh is None:
    return config, jax.tree.map(jax.numpy.asarray, params)
  return config, jax.device_put(params, api.param_shardings(config, mesh))


# our projection name -> the Hugging Face module it is (PEFT's target_modules)
_HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
               "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
               "router": "mlp.gate"}


def lora_to_peft(config: ModelConfig, params: dict[str, Any], dtype: Optional[str] = None
                 ) -> dict[str, np.ndarray]:
  """The adapters of a LoRA model as PEFT's tensors: per target, ``lora_A.weight`` ``[r, in]`` and
  ``lora_B.weight`` ``[out, r]`` under ``base_model.model.<HF module>``, so that PEFT's
  ``W x + (alpha / r) B A x`` is the model's ``x W + (alpha / r) (x A) B``."""
  if not config.lora:
    raise ValueError("the model has no LoRA adapters (model.lora.rank is 0)")
  if "router" in config.lora_targets:
    # transformers' Qwen3-MoE router (mlp.gate) is not a Linear layer, which PEFT's LoRA needs
    raise ValueError("model.lora.targets includes 'router', which PEFT cannot put on transformers' "
                     "Qwen3-MoE router; export the merged model instead (--format=hf)")
  dt = np.dtype(jax.numpy.dtype(dtype or config.param_dtype))
  adapters, _ = lora.split(params)
  out = {}
  for key, a in adapters.items():
    name = str(key[-1])
    if not name.endswith("_lora_a"):
      continue
    target = name[:-len("_lora_a")]
    layer = str(key[0])
    if not layer.startswith("layer_") or target not in _HF_MODULES:
      raise ValueError(f"unexpected adapter {'/'.join(map(str, key))}")
    a = np.asarray(jax.device_get(a)).astype(dt)
    b = np.asarray(jax.device_get(adapters[key[:-1] + (f"{target}_lora_b",)])).astype(dt)
    r = config.lora_rank
    prefix = f"base_model.model.model.layers.{layer[len('layer_'):]}.{_HF_MODULES[target]}."
    out[prefix + "lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
    out[prefix + "lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
  return out


def export_peft(config: ModelConfig, params: dict[str, Any], path: str, *, base_model: str,
                dtype: Optional[str] = None) -> None:
  """Writes the adapters alone in PEFT's layout: ``path/adapter_config.json`` (LoRA, rank, alpha,
  targets as Hugging Face module names, ``base_model_name_or_path=base_model``) and
  ``path/adapter_model.safetensors``; ``peft.PeftModel.from_pretrained`` puts them on the base
  model (``export_hf`` of the base, or the checkpoint the run started from)."""
  tensors = lora_to_peft(config, params, dtype)
  os.makedirs(path, exist_ok=True)
  safetensors_io.save(os.path.join(path, "adapter_model.safetensors"), tensors, metadata={"format": "pt"})
  adapter_config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "r": config.lora_rank, "lora_alpha": config.lora_alpha, "lora_dropout": 0.0, "bias": "none",
      "target_modules": sorted(_HF_MODULES[t].split(".")[-1] for t in config.lora_targets),
      "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
      "modules_to_save": None, "inference_mode": True}
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(adapter_config, f, indent=2)


def export_hf(config: ModelConfig, params: dict[str, Any], path: str, *, dtype: Optional[str] = None,
              tokenizer_dir: Optional[str] = None) -> None:
  """Writes ``path/config.json`` and ``path/model.safetensors`` (plus tokenizer files if given). A model
  with LoRA adapters is written merged (``lora.merge``): a plain model of the base's architecture."""
  config, params = lora.merge(config, params)
  os.makedirs(path, exist_ok=True)
  hf_config = config_to_hf(config)
  if dtype:
    hf_config["torch_dtype"] = hf_config["dtype"] = dtype
  safetensors_io.save(os.path.join(path, "model.safetensors"), params_to_hf(config, params, dtype),
                      metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  if tokenizer_dir:
    import shutil  # pylint: disable=import-outside-toplevel
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
      src = os.path.join(tokenizer_dir, name)
      if os.path.exists(src):
        shutil.copy(src, os.path.join(path, name))
