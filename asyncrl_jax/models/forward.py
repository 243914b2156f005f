"""How a training or scoring forward pass runs: options that change memory and speed, never the values.

``Forward`` gathers them (one frozen, hashable record, safe as a static jit argument), so the model,
the log-prob and value functions and the learner pass one thing instead of a growing list:

* ``attention``: ``"xla"`` (the reference: whole-row scores, or ``attention_chunk`` queries at a
  time) or ``"splash"`` (the Pallas TPU kernel ``jax.experimental.pallas.ops.tpu.splash_attention``:
  a block's scores stay on chip, blocks above the diagonal are skipped, its own backward pass keeps
  only the output and the log-sum-exp; on other backends it runs in Pallas' interpret mode, slowly,
  for tests). See ``models.attention``.
* ``remat``: what a block keeps for the backward pass (``REMAT_POLICIES``).
* ``attention_chunk``: queries per block of the ``"xla"`` attention (0: all at once).
* ``scan_layers``: the blocks as one ``lax.scan`` over their stacked parameters.
* ``decode``: how a decode step attends to its KV cache (``DECODE_KINDS``; ``rollout.decode_attention``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

ATTENTION_KINDS = ("xla", "splash")
# How a decode step (one new token per row) attends to its KV cache: "xla" reads every cache position
# (masked); "ragged" is the Pallas ragged paged attention kernel, reading each row's pages only up to
# its position (on a TPU; elsewhere an XLA stand-in of its contract, for tests).
DECODE_KINDS = ("xla", "ragged")

# What a rematerialised block keeps for its backward pass (MaxText's names where they exist):
#   none            no recomputation: every activation is kept
#   full            only the block's input; its forward runs again in the backward pass
#   minimal         the outputs of the weight matrix products (q/k/v/o, the MLP's three), nothing of
#                   attention's inside (jax's ``checkpoint_dots_with_no_batch_dims``)
#   dots_saveable   every matrix product's output, attention's score products included (the XLA
#                   attention's; the splash kernel keeps its own residuals either way)
#   minimal_offloaded  as ``minimal``, with the saved products moved to host memory between the
#                   passes (TPU: pinned host memory; the transfer overlaps compute)
REMAT_POLICIES = ("none", "full", "minimal", "dots_saveable", "minimal_offloaded")


class ForwardError(ValueError):
  """A forward-pass option is not allowed (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Forward:
  """Options of a training / scoring forward pass (see the module docstring)."""

  attention: str = "xla"
  remat: str = "none"
  attention_chunk: int = 0
  scan_layers: bool = False
  decode: str = "xla"

  def __post_init__(self):
    remat = {True: "full", False: "none"}.get(self.remat, self.remat) if isinstance(
        self.remat, bool) else self.remat
    object.__setattr__(self, "remat", remat)
    if self.attention not in ATTENTION_KINDS:
      raise ForwardError(f"attention={self.attention!r}: must be one of {ATTENTION_KINDS}")
    if self.remat not in REMAT_POLICIES:
      raise ForwardError(f"remat={self.remat!r}: must be one of {REMAT_POLICIES} (or True / False)")
    if self.decode not in DECODE_KINDS:
      raise ForwardError(f"decode={self.decode!r}: must be one of {DECODE_KINDS}")
    if not isinstance(self.attention_chunk, int) or self.attention_chunk < 0:
      raise ForwardError(f"attention_chunk={self.attention_chunk!r}: must be an integer >= 0")

  @classmethod
  def from_learner(cls, config) -> "Forward":
    """The learner's options: ``learner.attention``, ``learner.remat``, ``learner.attention_chunk``,
    ``learner.scan_layers``."""
    learner = config.learner
    return cls(attention=str(learner.get("attention", "xla")), remat=learner.remat,
               attention_chunk=int(learner.attention_chunk), scan_layers=bool(learner.scan_layers))

  def replace(self, **changes) -> "Forward":
    return dataclasses.replace(self, **changes)

  @property
  def rematerialises(self) -> bool:
    return self.remat != "none"

  def checkpoint_policy(self) -> Optional[callable]:
    """The ``jax.checkpoint`` policy of ``remat`` (None: save nothing but the inputs)."""
    policies = jax.checkpoint_policies
    if self.remat == "minimal":
      return policies.checkpoint_dots_with_no_batch_dims
    if self.remat == "dots_saveable":
      return policies.dots_saveable
    if self.remat == "minimal_offloaded":
      return policies.offload_dot_with_no_batch_dims(offload_src="device", offload_dst="pinned_host")
    return None  # "full": nothing saveable (and "none" never asks)
