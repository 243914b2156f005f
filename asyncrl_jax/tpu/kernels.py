"""Analytic costs of the Pallas kernels a program calls, which XLA's cost analysis cannot see into.

A Pallas kernel is a ``custom-call`` to ``tpu_custom_call`` in the optimized HLO: XLA counts no FLOPs
for it and only its operands' and results' bytes, once. A roofline built on that treats attention as
free. ``custom_call_cost`` gives each known kernel its work from the shapes in the HLO (the walker,
``hlo.analyze``, multiplies it by the loops around the call):

**Splash attention** (``models.attention.splash``; instructions named ``splash_mha_fwd...``,
``splash_mha_dq...``, ``splash_mha_dkv...``, or calls with those names in their ``op_name``). Operands ``q [R, Nq, T, H]``, ``k`` and ``v [R, Nk,
T, H]`` per device (``R`` rows: the kernel is mapped over them; ``[Nq, T, H]`` for one row), blocks of ``b`` queries and keys; the kernel this project builds is causal, so
of the ``n x n`` block pairs (``n = T / b``) it visits ``P = n (n + 1) / 2`` (the rest are skipped by
its block mask). Per visited pair and query head, a ``b x b x H`` matrix product costs
``2 b^2 H`` FLOPs, and:

=======  ===============================================  ======================================
kernel   products per pair                                 streamed per pair and query head
=======  ===============================================  ======================================
fwd      2 (``q k^T``, ``p v``)                            a block of ``k`` and of ``v``
dq       3 (``q k^T``, ``do v^T``, ``ds k``)                a block of ``k`` and of ``v``
dkv      4 (``q k^T``, ``do v^T``, ``p^T do``, ``ds^T q``)  a block of ``q`` and of ``do``
fused    5 (dkv's four and ``ds k``: dq and dk, dv in one)  a block of ``q`` and of ``do``
=======  ===============================================  ======================================

(The fused backward kernel is a ``dkv`` kernel that also returns dq, as partial sums per key block:
a result shaped like ``q``.)

FLOPs = products x 2 b^2 H x P x Nq x R. Bytes = the operands and results once (XLA's own cost
analysis leaves a custom call's operands and results out: the walker adds them) plus the streamed
blocks: 2 x b x H x itemsize x P x Nq x R (their re-reads, ``extra_bytes``).
Elementwise work (the softmax's exponentials) is not counted, as for XLA's own products. Masking
inside a block (segment ids, the diagonal) does not change the work: a visited block is computed
whole.

**Ragged paged attention** (``models.attention.ragged_decode``; ``ragged_paged_attention_kernel``):
each query token attends its row's positions up to its length, reading those pages once. The
lengths are values, not shapes, so the call is costed at the whole cache (``4 x tokens x heads x
head_dim x positions`` FLOPs, the pages' bytes) and both are marked as scaling with the live share
(``paged_flops``, ``paged_bytes``), which ``tpu.projection`` applies at the config's lengths.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Optional

_SPLASH = re.compile(r"splash_(mha|mqa)_(fwd|dq|dkv)")
_PRODUCTS = {"fwd": 2, "dq": 3, "dkv": 4, "fused_bwd": 5}
_FLOAT = re.compile(r"\b(bf16|f16|f32)\[([\d,]+)\]")
_MASK_INFO = re.compile(r"\bs8\[(\d+),(\d+),(\d+)\]")
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4}


class KernelCost(NamedTuple):
  kernel: str  # e.g. "splash_fwd"
  flops: float
  extra_bytes: float  # re-reads beyond its operands and results once (the walker adds those)
  # work and operand bytes that scale with the live length of a paged cache (counted here at the
  # whole cache: which pages a row reads depends on its position; ``tpu.projection`` scales them)
  paged_flops: float = 0.0
  paged_bytes: float = 0.0


def ragged_paged_cost(*, q_tokens: int, q_heads: int, head_dim: int, cache_positions: int,
                      pages_bytes: float) -> KernelCost:
  """One ragged paged attention call at most: every query token attending ``cache_positions``
  positions (2 products of 2 x head_dim FLOPs per position and head), its pages read once. All of
  it scales with the live share of the cache."""
  flops = 4.0 * q_tokens * q_heads * head_dim * cache_positions
  return KernelCost("ragged_paged_attention", flops, 0.0, paged_flops=flops, paged_bytes=pages_bytes)


def causal_block_pairs(blocks: int) -> int:
  """Block pairs a causal kernel visits in an ``blocks x blocks`` grid: the diagonal and below."""
  return blocks * (blocks + 1) // 2


def splash_cost(kind: str, *, q_heads: int, seq: int, head_dim: int, block: int, itemsize: int,
                rows: int = 1) -> KernelCost:
  """The cost of one causal splash ``kind`` call ("fwd", "dq", "dkv" or "fused_bwd") over ``rows``
  rows."""
  pairs = causal_block_pairs(math.ceil(seq / block)) * q_heads * rows
  flops = _PRODUCTS[kind] * 2.0 * block * block * head_dim * pairs
  streamed = 2.0 * block * head_dim * itemsize * pairs
  return KernelCost(f"splash_{kind}", flops, streamed)


def kernel_name(name: str, call_text: str = "") -> str:
  """The Pallas kernel a custom call runs: its instruction's name (``splash_mha_fwd...``), or, where
  the compiler renamed it (a kernel mapped over rows becomes a ``closed_call`` in a loop), the last
  kernel name in its ``op_name`` metadata."""
  found = _SPLASH.findall(name)
  if not found:
    op_name = re.search(r'op_name="([^"]*)"', call_text)
    found = _SPLASH.findall(op_name.group(1)) if op_name else []
  return f"splash_{found[-1][0]}_{found[-1][1]}" if found else ""


def custom_call_cost(name: str, operand_shapes: list, call_text: str = "",
                     result_shape: str = "") -> Optional[KernelCost]:
  """The cost of the custom call ``name`` (an instruction name in the HLO) from its operands' shape
  texts, the rest of its text and its result's shape text, or None for a call this module does not
  know."""
  if "ragged_paged_attention" in name or "ragged_paged_attention" in call_text[:2000]:
    return _ragged_cost(operand_shapes)
  m = _SPLASH.search(kernel_name(name, call_text))
  if not m:
    return None
  arrays = [(a.group(1), [int(d) for d in a.group(2).split(",")])
            for a in (_FLOAT.search(s) for s in operand_shapes) if a]
  arrays = [(dtype, dims) for dtype, dims in arrays if len(dims) in (3, 4)]
  if len(arrays) < 3:
    return None
  dtype, dims = arrays[0]  # q: [rows, heads, T, H] or [heads, T, H]
  rows = dims[0] if len(dims) == 4 else 1
  q_heads, seq, head_dim = dims[-3:]
  blocks = next((int(b.group(2)) for b in (_MASK_INFO.search(s) for s in operand_shapes) if b), 0)
  block = seq // blocks if blocks and seq % blocks == 0 else seq
  kind = m.group(2)
  # the fused backward is a dkv kernel that also returns dq (partial sums per key block): a result
  # shaped like q, [..., Nq, T, H]
  results = [[int(d) for d in a.group(2).split(",")] for a in _FLOAT.finditer(result_shape)]
  if kind == "dkv" and any(r[-3:] == [q_heads, seq, head_dim] for r in results if len(r) >= 3):
    kind = "fused_bwd"
  return splash_cost(kind, q_heads=q_heads, seq=seq, head_dim=head_dim, block=block,
                     itemsize=_ITEMSIZE[dtype], rows=rows)


def _ragged_cost(operand_shapes: list) -> Optional[KernelCost]:
  """Operands: kv_lens, page_indices [B, pages per row], cu_q_lens, (state), num_seqs, q [T, N, H],
  kv_pages [pages, page size, 2K, H]."""
  arrays = [(a.group(1), [int(d) for d in a.group(2).split(",")])
            for a in (_FLOAT.search(s) for s in operand_shapes) if a]
  table = next((re.search(r"\bs32\[(\d+),(\d+)\]", s) for s in operand_shapes
                if re.search(r"\bs32\[(\d+),(\d+)\]", s)), None)
  if len(arrays) < 2 or table is None:
    return None
  (_, q), (dtype, pages) = arrays[0], arrays[1]
  if len(q) != 3 or len(pages) != 4:
    return None
  return ragged_paged_cost(q_tokens=q[0], q_heads=q[1], head_dim=q[2],
                           cache_positions=int(table.group(2)) * pages[1],
                           pages_bytes=math.prod(pages) * _ITEMSIZE[dtype])
