"""A decode server's counters as one typed record, and the figures derived from them.

``DecodeStats`` is what the decode loop counts, what the ``Health`` RPC carries (a ``DecodeStats``
message that ``protocol`` generates from this class, one field per field), what the main job logs as
``decode_*`` columns of ``metrics.jsonl`` and what the benchmarks read back. Slot utilization, the
figure derived from them, has its one implementation here.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

PREFIX = "decode_"  # metrics.jsonl column prefix


@dataclasses.dataclass
class DecodeStats:
  """Cumulative counters since a decode server started (or their sum over ``servers`` servers)."""
  tokens: int = 0  # generated tokens kept in trajectories
  steps: int = 0  # decode steps run
  slot_steps: int = 0  # steps x slots: the token capacity of the steps run
  idle_seconds: float = 0.0  # waiting for work (summed over servers)
  interrupt_seconds: float = 0.0  # re-prefilling in-flight sequences after weight updates
  weight_updates: int = 0
  interrupted_sequences: int = 0  # re-prefilled under new weights (rollout.on_weight_update=recompute)
  continued_sequences: int = 0  # kept their cache across an update (keep_cache)
  started: int = 0  # requests prefilled into a slot
  rejected_requests: int = 0  # refused before decoding (finish_reason "error")
  finished_eos: int = 0
  finished_length: int = 0
  finished_aborted: int = 0
  finished_error: int = 0
  servers: int = 1
  # (new counters go here, at the end: the Health message numbers its fields in this order)
  drain_seconds: float = 0.0  # new weights waited for the sequences in flight (on_weight_update=drain)
  finished_turns: int = 0  # episodes ended by their turn limit
  finished_env_done: int = 0  # ended by the environment after an action that was not final
  finished_env_error: int = 0
  finished_env_timeout: int = 0
  env_steps: int = 0  # environment steps taken (episodes' actions answered)
  env_errors: int = 0  # environment steps that raised or timed out
  env_seconds: float = 0.0  # summed wall time of environment steps (slots parked meanwhile)

  @classmethod
  def counters(cls) -> tuple[str, ...]:
    """Every counter's name (all fields but ``servers``)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "servers")

  def count_finished(self, reason: str) -> None:
    name = f"finished_{reason}"
    if not hasattr(self, name):
      raise ValueError(f"unknown finish reason {reason!r}")
    setattr(self, name, getattr(self, name) + 1)

  def copy(self) -> "DecodeStats":
    return dataclasses.replace(self)

  def __add__(self, other: "DecodeStats") -> "DecodeStats":
    return DecodeStats(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                          for f in dataclasses.fields(self)})

  def since(self, base: "DecodeStats") -> "DecodeStats":
    """Counted after ``base`` was taken (the number of servers is kept)."""
    return DecodeStats(**{k: getattr(self, k) - getattr(base, k) for k in self.counters()},
                       servers=self.servers)

  def as_metrics(self) -> dict:
    """``decode_<counter>`` columns (and ``decode_servers``) for metrics.jsonl."""
    return {PREFIX + f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def from_metrics(cls, record: Mapping) -> "DecodeStats":
    """Reads the ``decode_*`` columns back (counters a log predates read as 0)."""
    return cls(**{f.name: record.get(PREFIX + f.name, f.default) for f in dataclasses.fields(cls)})

  def slot_utilization(self, seconds: float) -> Optional[float]:
    """Share of decode-slot capacity that produced tokens over ``seconds`` of wall time: occupancy of
    the decode steps run, times the share of time the servers were not waiting for work. ``None``
    before any decode step."""
    if not self.slot_steps:
      return None
    idle_share = self.idle_seconds / max(self.servers, 1) / max(seconds, 1e-9)
    return self.tokens / self.slot_steps * max(0.0, 1.0 - idle_share)
