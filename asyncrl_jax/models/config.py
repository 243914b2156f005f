"""Model hyper-parameters: a frozen, hashable dataclass (safe as a static jit argument)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

_DTYPES = ("float32", "bfloat16", "float16")
# the projections a LoRA adapter can sit on (``lora_targets``)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


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
    rms_norm_eps: epsilon inside RMSNorm.
    qkv_bias: q/k/v projections carry a bias (Qwen2: True, Llama: False).
    tie_embeddings: the output projection reuses the embedding table.
    max_seq_len: longest sequence (prompt + completion) the model is used with.
    dtype: activation / matmul dtype.
    param_dtype: storage dtype of the parameters.
    lora_rank: r > 0 adds a low-rank adapter to each projection in ``lora_targets``: ``W x`` becomes
      ``W x + (lora_alpha / r) B A x`` with ``A`` [in, r] and ``B`` [r, out], ``B`` zero at
      initialisation (``models.lora``). 0: no adapters.
    lora_alpha: the adapters' scale numerator.
    lora_targets: which projections carry adapters (of ``LORA_TARGETS``).
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
  lora_targets: tuple = LORA_TARGETS

  def __post_init__(self):
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
    unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
    if unknown or (self.lora_rank and not self.lora_targets) or len(set(self.lora_targets)) < len(
        self.lora_targets):
      raise ModelConfigError(f"model.lora.targets={','.join(self.lora_targets)!r}: must be distinct "
                             f"names of {','.join(LORA_TARGETS)}, at least one when model.lora.rank > 0")

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

  @property
  def num_params(self) -> int:
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.qkv_bias:
      attn += h * (self.num_heads + 2 * self.num_kv_heads)
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.num_layers * layer + d + head

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> "ModelConfig":
    """Builds from a dict (e.g. the ``model`` section of an experiment config, whose ``lora``
    subsection gives ``lora_rank``, ``lora_alpha``, ``lora_targets``), ignoring unknown keys."""
    fields = {f.name for f in dataclasses.fields(cls)}
    values = dict(values, **lora_fields(values.get("lora")))
    return cls(**{k: v for k, v in values.items() if k in fields})

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


def lora_fields(lora: Any) -> dict:
  """``ModelConfig``'s LoRA fields from a config's ``model.lora`` section (a mapping; None: none)."""
  if not lora:
    return {}
  lora = dict(lora)
  return {"lora_rank": lora.get("rank", 0), "lora_alpha": lora.get("alpha", 16.0),
          "lora_targets": lora.get("targets", LORA_TARGETS)}
