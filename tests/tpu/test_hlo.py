"""The HLO walker (``asyncrl_jax.tpu.hlo``): FLOPs, bytes and collectives with loops counted, against
XLA's own cost analysis (which counts a loop's body once) and hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax.tpu import hlo, kernels


def _compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile()


def _xla_flops(compiled) -> float:
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.parametrize("trips", [1, 7])
def test_a_loop_of_matmuls_counts_every_trip(trips):
  m, k, n = 64, 128, 32
  def fn(a, w):
    return jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w), a)
  a = jax.ShapeDtypeStruct((m, k), jnp.float32)
  w = jax.ShapeDtypeStruct((k, k), jnp.float32)
  compiled = _compiled(fn, a, w)
  cost = hlo.analyze(compiled.as_text())
  per_trip = 2 * m * k * k
  assert cost.flops == pytest.approx(trips * per_trip)
  assert cost.flops_once == pytest.approx(per_trip)
  # XLA's figure is the body once (matmul and the elementwise work), whatever the trip count: the
  # correction is needed (negative control: with 7 trips it is far below the truth)
  assert _xla_flops(compiled) == pytest.approx(per_trip, rel=0.1)
  if trips > 1:
    assert _xla_flops(compiled) < 0.2 * cost.flops
    assert (np.asarray([t for _, t in cost.loops]) == trips).all()
  del n


def test_a_loop_that_starts_past_zero_counts_its_trips_from_its_start():
  """A loop whose counter runs from 2 while below 7 (as a loop with a peeled first iteration runs
  from 1): 5 trips, not 7 (negative control below: read from 0, the count is 7)."""
  m, k = 64, 128
  fn = lambda a, w: jax.lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                                       (jnp.int32(2), a))[1]
  compiled = _compiled(fn, jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((k, k), jnp.float32))
  cost = hlo.analyze(compiled.as_text())
  assert [t for _, t in cost.loops] == [5]
  assert cost.flops == pytest.approx(5 * 2 * m * k * k)
  unaware = compiled.as_text().replace("constant(2)", "constant(0)")
  assert [t for _, t in hlo.analyze(unaware).loops] == [7]


def test_bytes_of_a_plain_program_match_xla():
  def fn(a, b):
    return jnp.exp(a) @ b + 1.0
  a = jax.ShapeDtypeStruct((256, 512), jnp.float32)
  b = jax.ShapeDtypeStruct((512, 128), jnp.float32)
  compiled = _compiled(fn, a, b)
  cost = hlo.analyze(compiled.as_text())
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, list) else xla
  assert cost.flops == pytest.approx(2 * 256 * 512 * 128)
  assert cost.bytes == pytest.approx(float(xla["bytes accessed"]), rel=0.25)
  # at least the inputs and the output pass through memory once
  assert cost.bytes >= (256 * 512 + 512 * 128 + 256 * 128) * 4


# A batched product as the TPU compiler writes it (from a v5p compile of the built-in model): the
# heads dimension as a spatial dimension padded so that each output position sees one kernel
# position. [4, 256, 128] x [128, 2, 32] -> [4, 256, 2, 32]: 4 * 256 * 2 * 32 outputs, 128 each.
_TPU_CONV = """HloModule m, entry_computation_layout={()->f32[4,256,2,32]}

ENTRY %main (p0: f32[4,256,128,1], p1: bf16[128,2,32,1]) -> f32[4,256,2,32] {
  %p0 = f32[4,256,128,1]{2,1,3,0:T(8,128)} parameter(0)
  %p1 = bf16[128,2,32,1]{0,2,1,3:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.100 = f32[4,256,2,32]{1,3,2,0:T(8,128)} convolution(%p0, %p1), window={size=1x2 pad=0_0x1_1 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f
}
"""


def test_a_batched_product_written_as_a_convolution():
  cost = hlo.analyze(_TPU_CONV)
  # dims: lhs 0bf1 = [4 (spatial 0), 256 (batch), 128 (feature), 1 (spatial 1)]; rhs i1o0 = [128 (in),
  # 2 (spatial 1), 32 (out), 1 (spatial 0)]; out 0b1f = [4, 256, 2, 32]. Spatial 1: 2 output
  # positions, kernel of 2 padded 1 on each side over an input of 1: each output sees 1 position.
  assert cost.flops == 2 * 256 * 32 * 128 * (4 * 2)


_COLLECTIVES = """HloModule m

%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %p = (s32[], f32[1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[1024]{0} get-tuple-element(%p), index=1
  %ag = f32[4096]{0} all-gather(%x), dimensions={0}, replica_groups={{0,1,2,3}}
  %cp = f32[1024]{0} collective-permute(%x), source_target_pairs={{0,1},{1,2}}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[1024]) tuple(%j, %cp)
}

%cond (p: (s32[], f32[1024])) -> pred[] {
  %p = (s32[], f32[1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(12)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]) tuple(%zero, %a)
  %w = (s32[], f32[1024]) while(%init), condition=%cond, body=%body
  %r = f32[1024]{0} get-tuple-element(%w), index=1
  ROOT %ar = f32[1024]{0} all-reduce(%r), replica_groups={{0,1,2,3}}, to_apply=%cond
}
"""


def test_collectives_are_counted_per_trip():
  cost = hlo.analyze(_COLLECTIVES)
  assert cost.loops == [("w", 12)]
  assert cost.collectives == {"all-gather": {"count": 12, "bytes": 12 * 4096 * 4},
                              "all-reduce": {"count": 1, "bytes": 1024 * 4},
                              "collective-permute": {"count": 12, "bytes": 12 * 1024 * 4}}


def test_a_loop_without_a_constant_bound_is_counted_once_and_reported():
  text = _COLLECTIVES.replace("%n = s32[] constant(12)\n", "%n = s32[] get-tuple-element(%p), index=0\n")
  cost = hlo.analyze(text)
  assert cost.loops == [("w", None)]
  assert cost.collectives["all-gather"]["count"] == 1


# An asynchronous call as XLA prints it: its start and done both name the wrapped computation, which
# runs once. 2 x 64 x 128 x 32 FLOPs.
_ASYNC = """HloModule m, entry_computation_layout={(f32[64,128]{1,0}, f32[128,32]{1,0})->f32[64,32]{1,0}}

%wrapped (p0: f32[64,128], p1: f32[128,32]) -> f32[64,32] {
  %p0 = f32[64,128]{1,0} parameter(0)
  %p1 = f32[128,32]{1,0} parameter(1)
  ROOT %d = f32[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[64,128], b: f32[128,32]) -> f32[64,32] {
  %a = f32[64,128]{1,0} parameter(0)
  %b = f32[128,32]{1,0} parameter(1)
  %start = ((f32[64,128]{1,0}, f32[128,32]{1,0}), f32[64,32]{1,0}, s32[]) async-start(%a, %b), calls=%wrapped
  %update = ((f32[64,128]{1,0}, f32[128,32]{1,0}), f32[64,32]{1,0}, s32[]) async-update(%start), calls=%wrapped
  ROOT %done = f32[64,32]{1,0} async-done(%update), calls=%wrapped
}
"""


def test_an_asynchronous_call_is_counted_once():
  cost = hlo.analyze(_ASYNC)
  assert cost.flops == pytest.approx(2 * 64 * 128 * 32)
  # negative control: the same computation called twice (two starts) counts twice
  twice = _ASYNC.replace("  ROOT %done", "  %start2 = ((f32[64,128]{1,0}, f32[128,32]{1,0}), "
                         "f32[64,32]{1,0}, s32[]) async-start(%a, %b), calls=%wrapped\n  ROOT %done")
  assert hlo.analyze(twice).flops == pytest.approx(2 * 2 * 64 * 128 * 32)


def test_the_splash_kernel_cost_is_the_hand_count():
  """12 query heads, 4096 tokens, head_dim 128, blocks of 512: 8 x 8 block pairs, 36 of them on or
  below the diagonal. Forward: 2 products of 2 x 512 x 512 x 128 FLOPs per pair and head."""
  fwd = kernels.splash_cost("fwd", q_heads=12, seq=4096, head_dim=128, block=512, itemsize=2)
  assert fwd.flops == 2 * (2 * 512 * 512 * 128) * 36 * 12 == 57_982_058_496
  # k and v re-read per visited pair and query head, 512 x 128 bf16 each
  assert fwd.extra_bytes == 2 * 512 * 128 * 2 * 36 * 12 == 113_246_208
  dq = kernels.splash_cost("dq", q_heads=12, seq=4096, head_dim=128, block=512, itemsize=2, rows=3)
  dkv = kernels.splash_cost("dkv", q_heads=12, seq=4096, head_dim=128, block=512, itemsize=2)
  fused = kernels.splash_cost("fused_bwd", q_heads=12, seq=4096, head_dim=128, block=512, itemsize=2)
  assert dq.flops == 3 * 3 / 2 * fwd.flops and dkv.flops == 2 * fwd.flops and fused.flops == 2.5 * fwd.flops
  assert kernels.causal_block_pairs(1) == 1 and kernels.causal_block_pairs(64) == 2080


@pytest.mark.slow(10)
def test_a_compiled_splash_gradient_is_costed_per_kernel_call():
  """The splash kernel compiled for a v5p chip inside a 3-trip loop (forward and gradient, each row
  with its own block tables, so the kernel runs in a loop over rows): XLA counts no FLOPs for its
  custom calls; the walker finds the forward and the fused backward kernels with their trips and
  costs them as ``splash_cost`` says."""
  from asyncrl_jax.models import attention
  from asyncrl_jax.tpu import compile as tpu_compile
  devices = tpu_compile.topology_devices("v5p", 4)
  mesh = jax.sharding.Mesh(np.asarray(devices[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  t, k, g, h = 1024, 2, 2, 128

  def loss(q, key, val, seg):
    def body(_, acc):
      out = attention.splash(q, key, val, seg, mesh=mesh)
      return acc + jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.lax.fori_loop(0, 3, body, 0.0)

  bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  args = (bf16(1, t, k, g, h), bf16(1, t, k, h), bf16(1, t, k, h), jax.ShapeDtypeStruct((1, t), jnp.int32))
  # (the tests' process-wide "highest" precision would ask Mosaic for float32 products of bf16)
  with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  cost = hlo.analyze(compiled.as_text())
  each = {kind: kernels.splash_cost(kind, q_heads=k * g, seq=t, head_dim=h, block=512, itemsize=2)
          for kind in ("fwd", "fused_bwd")}
  # the (fused) backward kernel runs per trip (the compiler keeps one more outside the loop); the
  # forward's inputs do not change, so XLA hoists it
  assert set(cost.kernels) == {"splash_fwd", "splash_fused_bwd"}, cost.kernels
  assert cost.kernels["splash_fused_bwd"] >= 3 and cost.kernels["splash_fwd"] >= 1
  want = sum(each[name.removeprefix("splash_")].flops * n for name, n in cost.kernels.items())
  assert cost.kernel_flops == pytest.approx(want)
  assert cost.kernel_flops >= 3 * each["fused_bwd"].flops + each["fwd"].flops
  assert cost.flops < 0.01 * cost.kernel_flops  # what XLA's own count sees of attention: nothing


@pytest.mark.slow(10)
def test_a_kernel_reads_its_operands_which_xla_does_not_count():
  """XLA's cost analysis leaves a Pallas call's operands out of its bytes: a paged decode over a
  128 MiB cache reports well under 1 MiB. The walker's kernel bytes hold the cache (read at most
  once), marked as scaling with the live share."""
  from asyncrl_jax.models import attention
  from asyncrl_jax.tpu import compile as tpu_compile
  devices = tpu_compile.topology_devices("v5p", 4)
  mesh = jax.sharding.Mesh(np.asarray(devices[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  b, s, k, g, h = 16, 8192, 2, 6, 128
  args = (jax.ShapeDtypeStruct((b, 1, k, g, h), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, s, 2 * k, h), jnp.bfloat16), jax.ShapeDtypeStruct((b,), jnp.int32))
  with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
    compiled = jax.jit(lambda q, kv, pos: attention.ragged_decode(q, kv, pos, mesh=mesh)).lower(*args).compile()
  cache = b * s * 2 * k * h * 2
  xla = compiled.cost_analysis()
  assert float((xla[0] if isinstance(xla, list) else xla)["bytes accessed"]) < cache / 100
  cost = hlo.analyze(compiled.as_text())
  assert cost.kernels == {"ragged_paged_attention": 1}
  assert cache <= cost.kernel_bytes <= 1.01 * cache and cost.paged_bytes == cache


_SCATTER = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused (p0: f32[64,1024], p1: s32[4,1], p2: f32[4,1024]) -> f32[64,1024] {
  %p0 = f32[64,1024]{1,0} parameter(0)
  %p1 = s32[4,1]{1,0} parameter(1)
  %p2 = f32[4,1024]{1,0} parameter(2)
  ROOT %r = f32[64,1024]{1,0} scatter(%p0, %p1, %p2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (c: f32[64,1024], i: s32[4,1], u: f32[4,1024]) -> f32[64,1024] {
  %c = f32[64,1024]{1,0} parameter(0)
  %i = s32[4,1]{1,0} parameter(1)
  %u = f32[4,1024]{1,0} parameter(2)
  ROOT %f = f32[64,1024]{1,0} fusion(%c, %i, %u), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/scatter"}
}
"""


def test_an_in_place_update_moves_its_update_not_the_whole_buffer():
  """A KV cache's write of one row per slot: the scatter fusion reads and writes the 4 updated rows
  (and reads the indices), not the 64-row cache it updates in place."""
  update = 4 * 1 * 4 + 4 * 1024 * 4
  cost = hlo.analyze(_SCATTER)
  assert cost.bytes == cost.hbm == 2 * update
  # control: a fusion of the same operands whose result is not an update in place moves them all
  plain = hlo.analyze(_SCATTER.replace("ROOT %r = f32[64,1024]{1,0} scatter(", "ROOT %r = f32[64,1024]{1,0} select("))
  assert plain.bytes == 2 * 64 * 1024 * 4 + update
  rows = hlo.breakdown(_SCATTER)
  assert rows[0]["op_name"] == "jit(f)/scatter" and rows[0]["bytes"] == 2 * update and rows[0]["share"] == 1.0


_PREFETCH = """HloModule m

ENTRY %main (w: bf16[1536,128], big: s8[1000]) -> bf16[1536,128] {
  %w = bf16[1536,128]{1,0} parameter(0)
  %big = s8[1000]{0} parameter(1)
  %cs = (bf16[1536,128]{1,0:S(1)}, bf16[1536,128]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %cd = bf16[1536,128]{1,0:S(1)} copy-done(%cs)
  %ss = ((s8[1000]{0}), s8[100]{0:S(1)}, s32[]{:S(2)}) slice-start(%big), slice={[0:100]}
  %sd = s8[100]{0:S(1)} slice-done(%ss)
  ROOT %n = bf16[1536,128]{1,0} negate(%cd)
}
"""


def test_hbm_bytes_leave_out_the_on_chip_copies_the_compiler_prefetches():
  """A weight prefetched into VMEM (memory space S(1)) crosses HBM once, read by the copy; the
  product that reads the VMEM copy reads no HBM. A prefetched slice reads only its 100 bytes."""
  w = 1536 * 128 * 2
  assert hlo.hbm_bytes("bf16[1536,128]{1,0:S(1)}") == 0 and hlo.hbm_bytes("bf16[1536,128]{1,0}") == w
  assert hlo.hbm_bytes("(bf16[8]{0:S(1)}, f32[8]{0}, u32[]{:S(2)})") == 32
  cost = hlo.analyze(_PREFETCH)
  assert cost.hbm == w + 100 + w  # copy's read, slice's read, negate's result (its operand is in VMEM)
  # every memory: the copy's read and VMEM write, the slice's read and write, negate's both
  assert cost.bytes == 2 * w + 2 * 100 + 2 * w
