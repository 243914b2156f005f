"""Model hyper-parameters: a frozen, hashable dataclass (safe as a static jit argument).

One decoder serves every supported family (MaxText-style: switches, not one class per family):

* Qwen2: ``qkv_bias``; Llama 2 / 3.x: no bias, ``rope_scaling`` of type ``llama3`` from 3.1 on;
* Qwen3: ``qk_norm`` (an RMSNorm over ``head_dim`` on each query and key head before RoPE), no bias,
  ``head_dim`` independent of ``hidden_size / num_heads``; ``rope_scaling`` ``yarn`` beyond 32k;
* Qwen3-MoE: Qwen3's attention with a mixture-of-experts MLP (``num_experts`` > 0,
  ``models.moe``) in the layers ``is_moe_layer`` names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

_DTYPES = ("float32", "bfloat16", "float16")
# the projections a LoRA adapter can sit on (``lora_targets``)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "router")
ATTENTION_TARGETS = ("q", "k", "v", "o")
DEFAULT_LORA_TARGETS = LORA_TARGETS[:-1]  # every projection of a dense model
# how a mixture-of-experts layer runs its experts (``models.moe``): grouped by expert with
# ``jax.lax.ragged_dot`` (dropless; CPU and TPU), or every expert on every token (the reference)
MOE_MATMULS = ("ragged", "dense", "megablox")
MOE_EXCHANGES = ("padded", "ragged")
ROPE_TYPES = ("default", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling as the hub's ``config.json`` writes it (``rope_scaling`` /
  ``rope_parameters``); applied once to the frequencies (``models.rope``).

  Attributes:
    rope_type: "default" (none), "llama3" (Llama 3.1+: by wavelength) or "yarn" (NTK-by-parts with an
      attention factor on cos / sin).
    factor: context extension factor.
    original_max_position_embeddings: the pre-training context the scaling is relative to.
    low_freq_factor, high_freq_factor: ``llama3``'s wavelength bounds.
    beta_fast, beta_slow: ``yarn``'s ramp bounds (rotations).
    attention_factor: ``yarn``'s scale of cos / sin (0: from ``factor``, ``mscale``, ``mscale_all_dim``).
    mscale, mscale_all_dim: ``yarn``'s optional attention-factor terms (0: unset).
    truncate: ``yarn`` rounds its correction range to whole dimensions.
  """

  rope_type: str = "default"
  factor: float = 1.0
  original_max_position_embeddings: int = 0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float = 0.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  truncate: bool = True

  def validate(self) -> None:
    if self.rope_type not in ROPE_TYPES:
      raise ModelConfigError(f"model.rope_scaling.rope_type={self.rope_type!r}: must be one of {ROPE_TYPES}")
    if self.rope_type == "default":
      return
    if not self.factor > 0:
      raise ModelConfigError(f"model.rope_scaling.factor={self.factor!r}: must be > 0")
    if not (isinstance(self.original_max_position_embeddings, int)
            and self.original_max_position_embeddings > 0):
      raise ModelConfigError(f"model.rope_scaling.original_max_position_embeddings="
                             f"{self.original_max_position_embeddings!r}: must be a positive integer")
    if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ModelConfigError(f"model.rope_scaling: llama3 needs 0 < low_freq_factor "
                             f"({self.low_freq_factor}) < high_freq_factor ({self.high_freq_factor})")
    if self.rope_type == "yarn" and not self.beta_fast > self.beta_slow > 0:
      raise ModelConfigError(f"model.rope_scaling: yarn needs beta_fast ({self.beta_fast}) > beta_slow "
                             f"({self.beta_slow}) > 0")

  @classmethod
  def from_mapping(cls, values: Optional[Mapping[str, Any]]) -> "RopeScaling":
    """From the config's ``model.rope_scaling`` section (None or {}: no scaling); unknown keys are
    refused by name."""
    if not values:
      return cls()
    if isinstance(values, RopeScaling):
      return values
    values = dict(values)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
      raise ModelConfigError(f"model.rope_scaling: unknown fields {unknown}; allowed: {sorted(fields)}")
    return cls(**values)


class ModelConfigError(ValueError):
  """A model configuration value is missing or not allowed."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer of the Qwen2 / Llama family.

  Attributes:
    vocab_size: V, rows of the embedding table.
    hidden_size: D, width of the residual stream.
    intermediate_size: F, width of the SwiGLU MLP.
    num_layers: L.
    num_heads: N query heads.
    num_kv_heads: K key/value heads (grouped-query attention; N % K == 0).
    head_dim: H; ``hidden_size // num_heads`` unless the checkpoint says otherwise.
    rope_theta: RoPE base frequency.
    rope_scaling: the frequencies' scaling (``RopeScaling``; default: none).
    rms_norm_eps: epsilon inside RMSNorm.
    qkv_bias: q/k/v projections carry a bias (Qwen2: True, Llama, Qwen3: False).
    qk_norm: an RMSNorm over ``head_dim`` on each query and key head before RoPE (Qwen3).
    tie_embeddings: the output projection reuses the embedding table.
    max_seq_len: longest sequence (prompt + completion) the model is used with.
    dtype: activation / matmul dtype.
    param_dtype: storage dtype of the parameters.
    lora_rank: r > 0 adds a low-rank adapter to each projection in ``lora_targets``: ``W x`` becomes
      ``W x + (lora_alpha / r) B A x`` with ``A`` [in, r] and ``B`` [r, out], ``B`` zero at
      initialisation (``models.lora``). 0: no adapters.
    lora_alpha: the adapters' scale numerator.
    lora_targets: which projections carry adapters (of ``LORA_TARGETS``; on a mixture-of-experts
      model the attention projections and the router, as the experts carry none).
    num_experts: E > 0 makes the MLP of the layers ``is_moe_layer`` names a mixture of E experts
      (``models.moe``); 0: every MLP dense.
    num_experts_per_tok: k, the experts each token is routed to.
    moe_intermediate_size: each expert's SwiGLU width.
    norm_topk_prob: the k routing weights are renormalised to sum to 1.
    decoder_sparse_step: every this many layers is a MoE layer (layer i when (i + 1) % step == 0).
    mlp_only_layers: layers kept dense whatever the step.
    moe_matmul: how the experts run (``MOE_MATMULS``): "ragged" grouped by expert, "dense" the
      reference (every expert on every token), "megablox" grouped by the megablox TPU kernel.
      Changes how, not what.
    moe_exchange: with expert parallelism (a mesh ``expert`` axis), how tokens travel to their
      experts' shard and back (``MOE_EXCHANGES``): "padded" an ``all_to_all`` of a buffer sized for
      the worst case (every token of a shard to one shard: dropless, and what runs on the CPU),
      "ragged" ``ragged_all_to_all`` moving only the routed rows (TPU, GPU; XLA:CPU has no such op).
      Changes how, not what.
    moe_capacity_factor: with expert parallelism, 0 (dropless: buffers for the worst case) or c >= 1:
      each shard sends at most c times the even share of its routing slots to each expert shard and
      drops the rest (``models.moe``). Changes what is computed when a slot is dropped.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int = 0
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = True
  tie_embeddings: bool = False
  max_seq_len: int = 2048
  dtype: str = "float32"
  param_dtype: str = "float32"
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple = DEFAULT_LORA_TARGETS
  rope_scaling: RopeScaling = RopeScaling()
  qk_norm: bool = False
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple = ()
  moe_matmul: str = "ragged"
  moe_exchange: str = "padded"
  moe_capacity_factor: float = 0.0

  def __post_init__(self):
    if not isinstance(self.rope_scaling, RopeScaling):
      object.__setattr__(self, "rope_scaling", RopeScaling.from_mapping(self.rope_scaling))
    if isinstance(self.mlp_only_layers, str):
      object.__setattr__(self, "mlp_only_layers", tuple(int(t) for t in self.mlp_only_layers.split(",")
                                                         if t.strip()))
    object.__setattr__(self, "mlp_only_layers", tuple(sorted(int(i) for i in self.mlp_only_layers)))
    if isinstance(self.lora_targets, str):  # (the config's comma-separated form)
      object.__setattr__(self, "lora_targets", tuple(t.strip() for t in self.lora_targets.split(",")
                                                     if t.strip()))
    object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
    if not self.head_dim:
      if self.num_heads <= 0 or self.hidden_size % self.num_heads:
        raise ModelConfigError(
            f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}; "
            "set model.head_dim explicitly")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    self.validate()

  def validate(self) -> None:
    """Raises ModelConfigError naming the first field that is not allowed."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**31:
        raise ModelConfigError(f"model.{name}={value!r}: must be a positive integer below 2**31")
    if self.num_heads % self.num_kv_heads:
      raise ModelConfigError(
          f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ModelConfigError(f"model.head_dim={self.head_dim}: RoPE needs an even head dimension")
    if not self.rope_theta > 0:
      raise ModelConfigError(f"model.rope_theta={self.rope_theta!r}: must be > 0")
    if not self.rms_norm_eps > 0:
      raise ModelConfigError(f"model.rms_norm_eps={self.rms_norm_eps!r}: must be > 0")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ModelConfigError(f"model.{name}={getattr(self, name)!r}: must be one of {_DTYPES}")
    if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
      raise ModelConfigError(f"model.lora.rank={self.lora_rank!r}: must be an integer >= 0 (0: no LoRA)")
    if not (isinstance(self.lora_alpha, (int, float)) and self.lora_alpha > 0):
      raise ModelConfigError(f"model.lora.alpha={self.lora_alpha!r}: must be > 0")
    self.rope_scaling.validate()
    self._validate_moe()
    unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
    if unknown or (self.lora_rank and not self.lora_targets) or len(set(self.lora_targets)) < len(
        self.lora_targets):
      raise ModelConfigError(f"model.lora.targets={','.join(self.lora_targets)!r}: must be distinct "
                             f"names of {','.join(LORA_TARGETS)}, at least one when model.lora.rank > 0")
    if self.lora_rank and self.num_experts:
      dense = [t for t in self.lora_targets if t in ("gate", "up", "down")]
      if dense and len(self.moe_layers) == self.num_layers:
        raise ModelConfigError(
            f"model.lora.targets={','.join(self.lora_targets)!r}: {dense} are dense-MLP projections, and "
            "every layer of this model is a mixture of experts (experts carry no adapters); use "
            f"{','.join(ATTENTION_TARGETS)} and optionally router")
    if self.lora_rank and "router" in self.lora_targets and not self.num_experts:
      raise ModelConfigError("model.lora.targets names 'router', but the model has no experts "
                             "(model.num_experts=0)")

  def _validate_moe(self) -> None:
    if self.moe_matmul not in MOE_MATMULS:
      raise ModelConfigError(f"model.moe_matmul={self.moe_matmul!r}: must be one of {MOE_MATMULS}")
    if self.moe_exchange not in MOE_EXCHANGES:
      raise ModelConfigError(f"model.moe_exchange={self.moe_exchange!r}: must be one of {MOE_EXCHANGES}")
    if self.moe_capacity_factor != 0 and not self.moe_capacity_factor >= 1:
      raise ModelConfigError(f"model.moe_capacity_factor={self.moe_capacity_factor!r}: must be 0 (dropless) "
                             "or >= 1 (below 1 drops slots even when the routing is perfectly even)")
    if not self.num_experts:
      if self.num_experts_per_tok or self.moe_intermediate_size:
        raise ModelConfigError("model.num_experts_per_tok / model.moe_intermediate_size are set but "
                               "model.num_experts=0 (a dense model)")
      return
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**31:
        raise ModelConfigError(f"model.{name}={value!r}: must be a positive integer for a "
                               "mixture-of-experts model")
    if self.num_experts_per_tok > self.num_experts:
      raise ModelConfigError(f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"model.num_experts={self.num_experts}")
    if self.num_experts > 2**15:
      raise ModelConfigError(f"model.num_experts={self.num_experts}: routes travel as int16 (at most 32768)")
    bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
    if bad:
      raise ModelConfigError(f"model.mlp_only_layers={list(self.mlp_only_layers)}: {bad} are not layers "
                             f"of a {self.num_layers}-layer model")
    if not self.moe_layers:
      raise ModelConfigError("model.num_experts > 0 but no layer is a mixture of experts "
                             "(decoder_sparse_step / mlp_only_layers exclude them all)")

  def is_moe_layer(self, i: int) -> bool:
    """Whether layer ``i``'s MLP is a mixture of experts (the hub's rule for Qwen3-MoE)."""
    return (self.num_experts > 0 and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0)

  @property
  def moe_layers(self) -> tuple:
    """The indices of the mixture-of-experts layers, in order."""
    return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

  @property
  def moe(self) -> bool:
    return self.num_experts > 0

  @property
  def route_shape(self) -> tuple:
    """Per token, the shape of its recorded routes: (MoE layers, experts per token)."""
    return len(self.moe_layers), self.num_experts_per_tok

  @property
  def lora(self) -> bool:
    """Whether the model carries LoRA adapters."""
    return self.lora_rank > 0

  @property
  def lora_scale(self) -> float:
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  @property
  def num_lora_params(self) -> int:
    """Parameters in the adapters (0 without LoRA)."""
    if not self.lora:
      return 0
    d, f, h, r = self.hidden_size, self.intermediate_size, self.head_dim, self.lora_rank
    sizes = {"q": (d, self.num_heads * h), "k": (d, self.num_kv_heads * h), "v": (d, self.num_kv_heads * h),
             "o": (self.num_heads * h, d), "gate": (d, f), "up": (d, f), "down": (f, d)}
    return self.num_layers * sum(r * (sizes[t][0] + sizes[t][1]) for t in self.lora_targets)

  def _count(self, experts: int) -> int:
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.qkv_bias:
      attn += h * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * h
    n_moe = len(self.moe_layers)
    moe_mlp = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
    layers = self.num_layers * (attn + 2 * d) + (self.num_layers - n_moe) * 3 * d * f + n_moe * moe_mlp
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + layers + d + head

  @property
  def num_params(self) -> int:
    """Every parameter (all experts), LoRA adapters excluded."""
    return self._count(self.num_experts)

  @property
  def num_expert_params(self) -> int:
    """The experts' weights (what expert parallelism splits): 0 for a dense model."""
    return len(self.moe_layers) * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

  @property
  def num_active_params(self) -> int:
    """The parameters a token passes through: a MoE layer's router and its k experts only (what
    6 x parameters per token counts); ``num_params`` for a dense model."""
    return self._count(self.num_experts_per_tok)

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> "ModelConfig":
    """Builds from a dict (e.g. the ``model`` section of an experiment config, whose ``lora``
    subsection gives ``lora_rank``, ``lora_alpha``, ``lora_targets``), ignoring unknown keys."""
    fields = {f.name for f in dataclasses.fields(cls)}
    values = dict(values, **lora_fields(values.get("lora")), **moe_fields(values.get("moe")))
    if "rope_scaling" in values:
      values["rope_scaling"] = RopeScaling.from_mapping(values["rope_scaling"])
    return cls(**{k: v for k, v in values.items() if k in fields})

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


def lora_fields(lora: Any) -> dict:
  """``ModelConfig``'s LoRA fields from a config's ``model.lora`` section (a mapping; None: none)."""
  if not lora:
    return {}
  lora = dict(lora)
  return {"lora_rank": lora.get("rank", 0), "lora_alpha": lora.get("alpha", 16.0),
          "lora_targets": lora.get("targets", DEFAULT_LORA_TARGETS)}


def moe_fields(moe: Any) -> dict:
  """``ModelConfig``'s mixture-of-experts fields from a config's ``model.moe`` section (a mapping
  with ``num_experts``, ``top_k``, ``intermediate_size``, ``norm_topk_prob``,
  ``decoder_sparse_step``, ``mlp_only_layers``, ``matmul``, ``exchange``, ``capacity_factor``; None or num_experts 0:
  dense)."""
  how = {"moe_matmul": dict(moe or {}).get("matmul", "ragged"),
         "moe_exchange": dict(moe or {}).get("exchange", "padded"),
         "moe_capacity_factor": float(dict(moe or {}).get("capacity_factor", 0.0))}
  if not moe or not dict(moe).get("num_experts"):
    return how
  moe = dict(moe)
  return {"num_experts": moe["num_experts"], "num_experts_per_tok": moe.get("top_k", 0),
          "moe_intermediate_size": moe.get("intermediate_size", 0),
          "norm_topk_prob": moe.get("norm_topk_prob", True),
          "decoder_sparse_step": moe.get("decoder_sparse_step", 1),
          "mlp_only_layers": moe.get("mlp_only_layers", ()), **how}
