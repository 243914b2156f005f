"""Cloud TPU generations: HBM, peak bf16 compute and HBM bandwidth per chip, and the topology of a
slice by its accelerator name.

Figures per chip from Cloud TPU's system-architecture pages (``SOURCES``). v4 and v5p name their
slices by TensorCores (two per chip: v5p-32 is 16 chips); v5e and v6e by chips.
"""

from __future__ import annotations

import dataclasses
import math
import re

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  kind: str
  hbm_bytes: int
  bf16_flops: float  # peak bf16 FLOP/s
  hbm_bandwidth: float  # bytes/s
  cores_in_name: int  # TensorCores per chip counted in the accelerator name (v5p-8 = 4 chips)
  dims: int  # torus dimensions of a slice
  host_chips: int  # chips per host of a multi-host slice
  source: str


CHIPS = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1200e9, 2, 3, 4, "https://cloud.google.com/tpu/docs/v4"),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9, 1, 2, 4, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9, 2, 3, 4, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1640e9, 1, 2, 4, "https://cloud.google.com/tpu/docs/v6e"),
}


def parse(accelerator: str) -> tuple[Chip, int]:
  """``"v5p-32"`` -> (the v5p chip, 16 chips); ``v5litepod-8`` is v5e."""
  match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator)
  kind = match and re.sub(r"litepod$", "e", match.group(1))
  if kind not in CHIPS:
    raise ValueError(f"accelerator {accelerator!r}: expected one of {sorted(CHIPS)} with a size, "
                     "e.g. v5p-8 or v6e-16")
  chip = CHIPS[kind]
  n = int(match.group(2))
  if n % chip.cores_in_name:
    raise ValueError(f"accelerator {accelerator!r}: {kind} sizes count {chip.cores_in_name} per chip")
  return chip, n // chip.cores_in_name


def host_chips(accelerator: str) -> int:
  """Chips on one host of the slice (a decode server is one host): v4/v5p 4; v5e/v6e 8 up to an
  8-chip slice, 4 per host beyond."""
  chip, n = parse(accelerator)
  if chip.kind in ("v4", "v5p"):
    return min(n, 4)
  return n if n <= 8 else 4


def topology_name(kind: str, chips: int) -> str:
  """The slice's topology for ``jax.experimental.topologies``: ``("v5p", 16)`` -> ``"v5p:2x2x4"``
  (the shapes Cloud TPU lists for each size; 2D tori for v5e/v6e, 3D for v4/v5p)."""
  chip = CHIPS[kind]
  if chip.dims == 2:
    if chips < 1 or chips & (chips - 1):
      raise ValueError(f"{kind} with {chips} chips: slices here are powers of two")
    if chips == 8:
      return f"{kind}:2x4"
    side = 2 ** (int(math.log2(chips)) // 2)
    return f"{kind}:{side}x{chips // side}"
  if chips not in _3D:
    raise ValueError(f"{kind} with {chips} chips: no slice shape of that size ({sorted(_3D)})")
  return f"{kind}:{_3D[chips]}"


# Chips per slice that each generation offers (the sizes the planner may give a role): 3D tori for
# v4 / v5p from a 4-chip host up; v5e / v6e from one chip.
SLICES = {"v4": (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
          "v5p": (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
          "v5e": (1, 4, 8, 16, 32, 64, 128, 256),
          "v6e": (1, 4, 8, 16, 32, 64, 128, 256)}

_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
       512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
