"""What an optimized HLO module does per run, read off its text (``compiled.as_text()``): FLOPs of its
matrix products, bytes its instructions touch, and its collectives, with every loop counted as many
times as it runs.

XLA's own ``cost_analysis()`` counts a ``while`` loop's body once, whatever its trip count: for a
program whose log-softmax runs over 19 vocabulary chunks and whose attention over 64 query blocks,
that undercounts most of the work. Here each computation is costed once and multiplied along the call
graph by the trip count of every loop that encloses it, read from the loop's condition (an induction
variable compared ``<`` a constant, as ``lax.scan``, ``fori_loop`` and ``lax.map`` lower, less the
variable's first value, which is 1 when the compiler peeled the first iteration out of the loop; a
loop that may stop early, like the decode chunk, is counted at its bound).

``analyze(text)`` returns ``Cost``: ``flops`` and ``bytes`` with loops counted, ``flops_once`` and
``bytes_once`` with every body counted once (what ``cost_analysis()`` measures: the ratio of the two
corrects XLA's figures), the loops found, and collectives by kind (count and bytes per run).

Counted: ``dot`` and ``convolution`` FLOPs (2 per multiply-add; convolutions over their valid window
positions, which is how the TPU compiler writes batched matrix products); elementwise work is not
(it is a few percent of a transformer's). Bytes: each top-level instruction's operands and result,
except those that move no data (parameters, tuples, bitcasts, constants). Pallas kernels (custom
calls) get their analytic cost from ``tpu.kernels``, kept apart (``kernel_flops``, ``kernel_bytes``:
their operands and results once, which XLA's figures leave out, plus their re-reads) because XLA's
own figures, which the ratio corrects, never include them. An asynchronous operation's
``-update`` and ``-done`` halves name the computation its ``-start`` runs: it is counted once.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from asyncrl_jax.tpu import kernels

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "token": 0}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|called_computations)="
                    r"(\{[^}]*\}|%?[\w.\-]+)")
NO_TRAFFIC = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all",
              "partition-id", "replica-id", "iota", "while", "call", "conditional", "call-start",
              "async-start", "async-update", "async-done"}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all",
               "collective-broadcast", "ragged-all-to-all")


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str  # the result's shape text (an array, or a tuple of them)
  opcode: str
  operands: list
  attrs: str
  literal: str = ""  # the text inside the parentheses (a constant's value, a parameter's number)
  root: bool = False  # its computation's result


@dataclasses.dataclass
class Cost:
  flops: float = 0.0
  bytes: float = 0.0
  flops_once: float = 0.0
  bytes_once: float = 0.0
  loops: list = dataclasses.field(default_factory=list)  # (loop name, trip count or None)
  collectives: dict = dataclasses.field(default_factory=dict)  # kind -> {"count", "bytes"}
  # Pallas kernels (custom calls XLA cannot see into) at their analytic cost (``tpu.kernels``), loops
  # counted: FLOPs, bytes beyond their operands and results, calls per kernel
  kernel_flops: float = 0.0
  kernel_bytes: float = 0.0
  kernel_reread_bytes: float = 0.0  # of which re-reads (what a block-skipping kernel skips)
  kernels: dict = dataclasses.field(default_factory=dict)
  # of which (flops) or of the operands' bytes: what scales with a paged cache's live share
  paged_flops: float = 0.0
  paged_bytes: float = 0.0
  # where the HBM bytes go: top-level instruction -> bytes per run in HBM (``hbm_bytes``: not the
  # on-chip copies the compiler prefetches into; loops counted; a kernel's analytic bytes included),
  # for ``breakdown``; their sum, ``hbm``
  by_instruction: dict = dataclasses.field(default_factory=dict)
  hbm: float = 0.0


def shape_bytes(shape: str) -> float:
  """Bytes of every array in a shape's text (a tuple's elements summed)."""
  return sum(_DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x)
             for d, dims in _ARRAY.findall(shape))


_LAID_OUT = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True))
                       + r")\[([\d,]*)\](\{[^}]*\})?")


def hbm_bytes(shape: str) -> float:
  """Bytes of the arrays of a shape's text that live in HBM: those whose layout names no other
  memory space (``S(1)``: the TPU's on-chip VMEM, where the compiler prefetches weights;
  ``S(2)``: scalar memory; ``S(5)``: pinned host memory)."""
  total = 0.0
  for d, dims, layout in _LAID_OUT.findall(shape):
    space = re.search(r"S\((\d+)\)", layout or "")
    if space is None or space.group(1) == "0":
      total += _DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x)
  return total


def _dims(shape: str) -> list:
  m = _ARRAY.search(shape)
  return [int(x) for x in m.group(2).split(",") if x] if m else []


def _split_shape(rest: str) -> tuple[str, str]:
  """``"f32[2]{0} add(%a, %b), ..."`` -> (shape, the rest); a tuple shape ends at its closing paren."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  shape, _, tail = rest.partition(" ")
  return shape, tail


def _split_call(tail: str) -> tuple[str, list, str, str]:
  """``"add(%a, %b), attrs"`` -> ("add", ["a", "b"], "attrs", "%a, %b")."""
  opcode, _, rest = tail.partition("(")
  depth, i = 1, 0
  while i < len(rest) and depth:
    depth += rest[i] == "("
    depth -= rest[i] == ")"
    i += 1
  inside = rest[:i - 1]
  return opcode.strip(), re.findall(r"%([\w.\-]+)", inside), rest[i:], inside.strip()


def parse(text: str) -> tuple[dict, str]:
  """Computations (name -> list of ``Instruction``) of an HLO module's text, and the entry's name."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = computations.setdefault(header.group(2), [])
      entry = header.group(2) if header.group(1) else entry
      continue
    if current is None or line.strip() == "}":
      continue
    m = _INSTR.match(line)
    if not m:
      if current:  # an instruction printed over several lines (a kernel's metadata holds newlines)
        current[-1].attrs += " " + line.strip()
      continue
    shape, tail = _split_shape(m.group(3))
    opcode, operands, attrs, literal = _split_call(tail)
    current.append(Instruction(m.group(2), shape, opcode, operands, attrs, literal, root=bool(m.group(1))))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


def _conv_flops(instr: Instruction, shapes: dict) -> float:
  """2 x multiply-adds of a convolution over its valid window positions (padding excluded)."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.attrs)
  window = re.search(r"window=\{([^}]*)\}", instr.attrs)
  lhs, rhs = (_dims(shapes.get(o, "")) for o in instr.operands[:2])
  out = _dims(instr.shape)
  if not labels or not lhs or not rhs or not out:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  fields = {}
  for item in (window.group(1).split() if window else []):
    key, _, value = item.partition("=")
    fields[key] = value.split("x")
  spatial = sorted(c for c in rhs_l if c.isdigit())
  pairs = 1
  for j, d in enumerate(spatial):
    size = rhs[rhs_l.index(d)]
    n_in, n_out = lhs[lhs_l.index(d)], out[out_l.index(d)]
    stride = int(fields.get("stride", ["1"] * len(spatial))[j])
    pad_lo = int(fields.get("pad", ["0_0"] * len(spatial))[j].split("_")[0])
    dil = int(fields.get("rhs_dilate", ["1"] * len(spatial))[j])
    base = int(fields.get("lhs_dilate", ["1"] * len(spatial))[j])
    extent = (n_in - 1) * base + 1
    valid = 0
    for k in range(size):  # output positions o with an input position inside the (dilated) input
      off = k * dil - pad_lo
      lo = max(0, -(off // stride) if off < 0 else 0)
      while lo < n_out and lo * stride + off < 0:
        lo += 1
      hi = min(n_out - 1, (extent - 1 - off) // stride) if extent - 1 - off >= 0 else -1
      count = 0
      if hi >= lo:
        count = hi - lo + 1
        if base > 1:  # only positions on the input's (undilated) grid hold data
          count = sum(1 for o in range(lo, hi + 1) if (o * stride + off) % base == 0)
      valid += count
    pairs *= valid
  batch = out[out_l.index("b")]
  return 2.0 * batch * out[out_l.index("f")] * rhs[rhs_l.index("i")] * pairs


def _dot_flops(instr: Instruction, shapes: dict) -> float:
  lhs = _dims(shapes.get(instr.operands[0], "")) if instr.operands else []
  m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
  contracted = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m and lhs else 1
  return 2.0 * math.prod(_dims(instr.shape)) * contracted


def _trip_count(condition: list, computations: dict) -> int | None:
  """The bound N of a loop whose condition compares an induction variable ``< N`` (a constant),
  directly or inside a fusion of the condition."""
  constants = {i.name: int(i.literal) for i in condition
               if i.opcode == "constant" and re.fullmatch(r"-?\d+", i.literal)}
  bounds = []
  for instr in condition:
    if instr.opcode == "compare" and "direction=LT" in instr.attrs and len(instr.operands) == 2:
      bounds.append(constants.get(instr.operands[1]))
    elif instr.opcode == "fusion":
      for called in re.findall(r"calls=%?([\w.\-]+)", instr.attrs):
        inner = computations.get(called, [])
        params = {i.name: int(i.literal) for i in inner if i.opcode == "parameter"}
        for c in inner:
          if c.opcode == "compare" and "direction=LT" in c.attrs and c.operands[1:2] and \
              c.operands[1] in params and params[c.operands[1]] < len(instr.operands):
            bounds.append(constants.get(instr.operands[params[c.operands[1]]]))
  bounds = [b for b in bounds if b is not None]
  return max(bounds) if bounds else None


def _induction_index(condition: list, computations: dict) -> int | None:
  """Which element of the loop's state tuple the condition compares ``<`` its bound (a
  ``get-tuple-element`` of the condition's parameter, directly or through a fusion)."""
  by_name = {i.name: i for i in condition}

  def tuple_index(name):
    instr = by_name.get(name)
    m = instr and instr.opcode == "get-tuple-element" and re.search(r"index=(\d+)", instr.attrs)
    return int(m.group(1)) if m else None

  for instr in condition:
    if instr.opcode == "compare" and "direction=LT" in instr.attrs and instr.operands:
      return tuple_index(instr.operands[0])
    if instr.opcode == "fusion":
      for called in re.findall(r"calls=%?([\w.\-]+)", instr.attrs):
        inner = computations.get(called, [])
        params = {i.name: int(i.literal) for i in inner if i.opcode == "parameter"}
        for c in inner:
          if c.opcode == "compare" and "direction=LT" in c.attrs and c.operands[:1] and \
              c.operands[0] in params and params[c.operands[0]] < len(instr.operands):
            return tuple_index(instr.operands[params[c.operands[0]]])
  return None


def _loop_start(loop: Instruction, index: int | None, by_name: dict) -> int:
  """The induction variable's first value: the constant the loop's initial state holds at
  ``index`` (through copies), 0 when it cannot be read. The compiler may peel a first iteration out
  of a loop, which then starts at 1."""
  init = by_name.get(loop.operands[0]) if loop.operands else None
  if index is None or init is None or init.opcode != "tuple" or index >= len(init.operands):
    return 0
  value = by_name.get(init.operands[index])
  for _ in range(4):
    if value is None or value.opcode == "constant":
      break
    value = by_name.get(value.operands[0]) if value.opcode in ("copy", "bitcast", "convert") else None
  if value is not None and value.opcode == "constant" and re.fullmatch(r"-?\d+", value.literal):
    return int(value.literal)
  return 0


_IN_PLACE = ("scatter", "dynamic-update-slice")


def _moved(instr: Instruction, shapes: dict, roots: dict, size=shape_bytes) -> float:
  """Bytes ``instr`` moves: its operands and result, except for an in-place update (a scatter or
  dynamic-update-slice, or a fusion whose result is one, into an operand of the result's shape):
  that touches only the update, read and written, not the whole buffer it writes into."""
  operands = [shapes.get(o, "") for o in instr.operands]
  if instr.opcode == "copy-start":  # result: (destination, the source itself, a context): one copy
    first = _LAID_OUT.search(instr.shape)
    return sum(size(x) for x in operands) + (size(first.group(0)) if first else 0.0)
  if instr.opcode in ("slice-start", "dynamic-slice-start"):  # ((source), slice, context): reads the
    found = _LAID_OUT.findall(instr.shape)                     # slice, writes it where it goes
    if len(found) >= 2:
      d, dims, layout = found[-2]
      whole = f"{d}[{dims}]"
      return shape_bytes(whole) + size(whole + layout)
  root = instr
  if instr.opcode == "fusion":
    called = re.findall(r"calls=%?([\w.\-]+)", instr.attrs)
    root = roots.get(called[0]) if called else None
  if root is not None and root.opcode in _IN_PLACE and instr.shape in operands:
    rest = list(operands)
    rest.remove(instr.shape)
    return 2 * sum(size(x) for x in rest)
  return size(instr.shape) + sum(size(x) for x in operands)


def _own_cost(instrs: list, shapes: dict, roots: dict) -> tuple:
  """A computation's own instructions (not those it calls): matrix-product FLOPs, bytes moved,
  collectives (kind -> [count, bytes]) and its known kernels with their operand and result bytes."""
  flops = traffic = 0.0
  coll = collections.defaultdict(lambda: [0, 0.0])
  custom, each = [], []
  for instr in instrs:
    if instr.opcode == "convolution":
      flops += _conv_flops(instr, shapes)
    elif instr.opcode == "dot":
      flops += _dot_flops(instr, shapes)
    elif instr.opcode == "custom-call":
      kernel = kernels.custom_call_cost(instr.name, [shapes.get(o, "") for o in instr.operands],
                                        instr.attrs, instr.shape)
      if kernel is not None:
        # XLA's own count leaves out a custom call's operands and results: the kernel's traffic
        # is those (read and written once) plus what its cost adds
        io = shape_bytes(instr.shape) + sum(shape_bytes(shapes.get(o, "")) for o in instr.operands)
        custom.append((kernel, io, instr.name))
    kind = instr.opcode.removesuffix("-start")
    if kind in COLLECTIVES and not instr.opcode.endswith("-done"):
      coll[kind][0] += 1
      # an async start's result is a tuple (its operand, its result, and context scalars): the
      # data it moves is its largest array
      coll[kind][1] += max((shape_bytes(f"{d}[{dims}]") for d, dims in _ARRAY.findall(instr.shape)),
                           default=0.0)
    if instr.opcode not in NO_TRAFFIC and not instr.opcode.endswith("-done"):
      traffic += _moved(instr, shapes, roots)
      each.append((instr, _moved(instr, shapes, roots, hbm_bytes)))
  return flops, traffic, coll, custom, each


def analyze(text: str) -> Cost:
  """The module's ``Cost`` per run (see the module docstring)."""
  computations, entry = parse(text)
  shapes = {i.name: i.shape for instrs in computations.values() for i in instrs}
  roots = {name: next((i for i in instrs if i.root), instrs[-1] if instrs else None)
           for name, instrs in computations.items()}
  own = {name: _own_cost(instrs, shapes, roots) for name, instrs in computations.items()}
  fused = {c for instrs in computations.values() for i in instrs if i.opcode == "fusion"
           for c in re.findall(r"calls=%?([\w.\-]+)", i.attrs)}
  cost = Cost()
  totals = collections.defaultdict(lambda: [0, 0.0])

  calls = collections.Counter()

  def visit(name: str, times: float, once: float, inside_fusion: bool) -> None:
    flops, traffic, coll, custom, each = own.get(name, (0.0, 0.0, {}, [], []))
    cost.flops += flops * times
    cost.flops_once += flops * once
    for kernel, io, _ in custom:
      cost.kernel_flops += kernel.flops * times
      cost.kernel_bytes += (kernel.extra_bytes + io) * times
      cost.kernel_reread_bytes += kernel.extra_bytes * times
      cost.paged_flops += kernel.paged_flops * times
      cost.paged_bytes += kernel.paged_bytes * times
      calls[kernel.kernel] += times
    if not inside_fusion:  # a fusion's inner instructions are one kernel: its own operands count
      cost.bytes += traffic * times
      cost.bytes_once += traffic * once
      for instr, moved in each:
        extra = sum(k.extra_bytes for k, _, n in custom if n == instr.name)
        key = (name, instr.name)
        cost.by_instruction[key] = cost.by_instruction.get(key, 0.0) + (moved + extra) * times
        cost.hbm += (moved + extra) * times
    for kind, (count, size) in coll.items():
      totals[kind][0] += count * times
      totals[kind][1] += size * times
    for instr in computations.get(name, []):
      if instr.opcode.endswith(("-done", "-update")):
        continue  # an async operation's later halves name the computation its start already ran
      called = {k: re.findall(r"%?([\w.\-]+)", v) for k, v in _CALLS.findall(instr.attrs)}
      if instr.opcode == "while":
        body, cond = called.get("body", [None])[0], called.get("condition", [None])[0]
        condition = computations.get(cond, [])
        trips = _trip_count(condition, computations)
        if trips is not None:  # counted from the induction variable's first value
          start = _loop_start(instr, _induction_index(condition, computations),
                              {i.name: i for i in computations.get(name, [])})
          trips = max(trips - start, 0)
        cost.loops.append((instr.name, trips))
        visit(body, times * (trips or 1), once, inside_fusion)
        continue
      for kind, names in called.items():
        if kind in ("to_apply",):  # scalar reducers: per element, not counted
          continue
        for c in names:
          visit(c, times, once, inside_fusion or c in fused)

  visit(entry, 1.0, 1.0, False)
  cost.collectives = {k: {"count": int(v[0]), "bytes": float(v[1])} for k, v in sorted(totals.items())}
  cost.kernels = {k: int(v) for k, v in sorted(calls.items())}
  return cost


def breakdown(text: str, top: int = 15) -> list[dict]:
  """The ``top`` instructions of an optimized HLO module by the bytes they move per run (loops
  counted), each with its opcode, result shape, the JAX operation it came from (``op_name``) and
  its share of the whole: where a memory-bound program's time goes."""
  computations, _ = parse(text)
  by_name = {(c, i.name): i for c, instrs in computations.items() for i in instrs}
  cost = analyze(text)
  total = sum(cost.by_instruction.values()) or 1.0
  rows = []
  for key, moved in sorted(cost.by_instruction.items(), key=lambda kv: -kv[1])[:top]:
    instr = by_name[key]
    op = re.search(r'op_name="([^"]*)"', instr.attrs)
    rows.append({"instruction": key[1], "opcode": instr.opcode, "shape": instr.shape[:120],
                 "op_name": op.group(1)[-120:] if op else "", "bytes": moved, "share": moved / total})
  return rows
