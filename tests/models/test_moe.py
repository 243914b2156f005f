"""The mixture-of-experts layer: routing by hand, the grouped path against the dense reference, routing
replay, the router statistics, scanned layers, KV-cache decoding and sharding."""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.models import moe
from tests.fixtures.helpers import sharp_params

CFG = models.ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_seq_len=64, rope_theta=100.0, qkv_bias=False,
                         qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def params():
  return sharp_params(CFG, 0, scale=3.0)


def _tokens(shape, seed=0):
  return np.random.default_rng(seed).integers(3, CFG.vocab_size, size=shape).astype(np.int32)


def test_route_by_hand():
  logits = np.log(np.array([[0.1, 0.5, 0.15, 0.25]], np.float32))
  experts, weights, probs = moe.route(jnp.asarray(logits), 2, norm_topk_prob=False)
  np.testing.assert_array_equal(experts, [[1, 3]])
  np.testing.assert_allclose(weights, [[0.5, 0.25]], rtol=1e-6)
  np.testing.assert_allclose(probs, [[0.1, 0.5, 0.15, 0.25]], rtol=1e-6)
  _, weights, _ = moe.route(jnp.asarray(logits), 2, norm_topk_prob=True)
  np.testing.assert_allclose(weights, [[2 / 3, 1 / 3]], rtol=1e-6)
  # replayed experts: the router's own probabilities at those experts, renormalised alike
  experts, weights, _ = moe.route(jnp.asarray(logits), 2, norm_topk_prob=True,
                                  routes_nk=jnp.asarray([[0, 2]], jnp.int16))
  np.testing.assert_array_equal(experts, [[0, 2]])
  np.testing.assert_allclose(weights, [[0.4, 0.6]], rtol=1e-6)


def test_load_balancing_loss_by_hand():
  e = 4
  uniform = jnp.full((8, e), 1.0 / e)
  experts = jnp.asarray([[0, 1], [2, 3]] * 4)
  loss, load = moe.load_balancing_loss(uniform, experts, jnp.ones(8))
  assert float(loss) == pytest.approx(1.0)  # balanced routing: the minimum
  np.testing.assert_allclose(load, [0.25] * 4)
  collapsed = jnp.tile(jnp.asarray([[1.0, 0, 0, 0]]), (8, 1))
  loss, load = moe.load_balancing_loss(collapsed, jnp.asarray([[0, 1]] * 8), jnp.ones(8))
  assert float(loss) == pytest.approx(e * 0.5 * 1.0)  # f_0 = 1/2, P_0 = 1
  # padding (valid 0) is not counted
  loss, load = moe.load_balancing_loss(collapsed, jnp.asarray([[0, 1]] * 8), jnp.asarray([1.0] + [0.0] * 7))
  np.testing.assert_allclose(load, [0.5, 0.5, 0, 0])


def test_grouped_experts_equal_the_dense_reference_values_and_gradients():
  rng = np.random.default_rng(0)
  n, d, f, e, k = 24, 8, 6, 5, 2
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  experts = jnp.asarray(np.stack([rng.choice(4, size=k, replace=False) for _ in range(n)]))  # expert 4 idle
  weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(n, k)), jnp.float32)
  w = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
  grouped = moe.experts_grouped(x, experts, weights, *w)
  dense = moe.experts_dense(x, experts, weights, *w)
  assert float(jnp.abs(dense).max()) > 1.0
  np.testing.assert_allclose(grouped, dense, atol=1e-5, rtol=1e-5)
  # a token by hand: its two experts' SwiGLU outputs, weighted
  i = 3
  by_hand = sum(weights[i, j] * ((jax.nn.silu(x[i] @ w[0][ex]) * (x[i] @ w[1][ex])) @ w[2][ex])
                for j, ex in enumerate(np.asarray(experts[i])))
  np.testing.assert_allclose(grouped[i], by_hand, atol=1e-5, rtol=1e-5)
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(a[0], experts, a[1], *a[2:])))
  g_grouped = jax.grad(loss(moe.experts_grouped), argnums=(0, 1, 2, 3, 4))(x, weights, *w)
  g_dense = jax.grad(loss(moe.experts_dense), argnums=(0, 1, 2, 3, 4))(x, weights, *w)
  for a, b in zip(g_grouped, g_dense):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  assert float(jnp.abs(g_grouped[2][4]).max()) == 0.0  # the idle expert gets no gradient
  # the megablox kernel (in Pallas' interpreter here): the same values and gradients
  megablox = moe.EXPERT_PATHS["megablox"]
  np.testing.assert_allclose(megablox(x, experts, weights, *w), dense, atol=1e-5, rtol=1e-5)
  g_megablox = jax.grad(loss(megablox), argnums=(0, 1, 2, 3, 4))(x, weights, *w)
  for a, b in zip(g_megablox, g_dense):  # (gradients up to ~11: its backward kernels sum by tile)
    np.testing.assert_allclose(a, b, atol=1e-3, rtol=1e-4)


def test_the_model_on_both_expert_paths_agrees(params):
  tokens = _tokens((2, 12))
  ragged = models.logits(CFG, params, tokens)
  dense = models.logits(CFG.replace(moe_matmul="dense"), params, tokens)
  np.testing.assert_allclose(ragged, dense, atol=1e-4, rtol=1e-5)


def test_routing_replay_uses_the_recorded_experts(params):
  tokens = _tokens((2, 12))
  logits, routes, aux, load = models.logits_and_routes(CFG, params, tokens)
  assert routes.dtype == jnp.int16 and routes.shape == (2, 12, 2, 2)
  np.testing.assert_allclose(logits, models.logits(CFG, params, tokens), atol=1e-6)
  assert load.shape == (2, 8) and np.allclose(np.sum(load, -1), 1.0) and float(aux) >= 1.0 - 1e-6
  # replaying the model's own routes changes nothing
  replayed, again, _, _ = models.logits_and_routes(CFG, params, tokens, routes=routes)
  np.testing.assert_allclose(replayed, logits, atol=1e-6)
  np.testing.assert_array_equal(again, routes)
  # other routes (each token's second choice and the next expert): the learner's experts are the
  # replayed ones, and the logits move (the control)
  other = np.asarray(routes).copy()
  other[..., 0] = (other[..., 1] + 1) % 8
  other[..., 0] = np.where(other[..., 0] == other[..., 1], (other[..., 0] + 1) % 8, other[..., 0])
  moved, used, _, _ = models.logits_and_routes(CFG, params, tokens, routes=other)
  np.testing.assert_array_equal(used, other)
  assert float(jnp.abs(moved - logits).max()) > 1e-2


def test_the_router_trains_under_replay(params):
  tokens = _tokens((2, 12))
  _, routes, _, _ = models.logits_and_routes(CFG, params, tokens)

  def loss(p):
    return jnp.mean(models.logits_and_routes(CFG, p, tokens, routes=routes)[0] ** 2)

  grads = jax.grad(loss)(params)
  assert float(jnp.abs(grads["layer_0"]["mlp"]["router"]).max()) > 0.0


def test_scanned_layers_equal_the_unrolled_loop(params):
  tokens = _tokens((2, 12))
  scanned = models.Forward(scan_layers=True, remat="full")
  want = models.logits_and_routes(CFG, params, tokens)
  got = models.logits_and_routes(CFG, params, tokens, forward=scanned)
  for a, b in zip(want, got):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)
  replayed = models.logits_and_routes(CFG, params, tokens, routes=want[1], forward=scanned)
  np.testing.assert_allclose(replayed[0], want[0], atol=1e-5)


def test_scanning_mixed_layers_is_refused(params):
  mixed = CFG.replace(mlp_only_layers=(0,))
  p = models.init_params(mixed, jax.random.key(0))
  with pytest.raises(ValueError, match="mixes dense and mixture-of-experts layers"):
    models.logits_and_routes(mixed, p, _tokens((1, 4)), forward=models.Forward(scan_layers=True))


def test_padding_is_not_counted_in_the_router_statistics(params):
  tokens = _tokens((1, 12))
  segments = np.ones((1, 12), np.int32)
  _, _, _, load = models.logits_and_routes(CFG, params, tokens[:, :6])
  segments[:, 6:] = 0
  _, _, _, padded = models.logits_and_routes(CFG, params, tokens, segment_ids=segments)
  np.testing.assert_allclose(padded, load, atol=1e-6)


def test_prefill_then_decode_steps_match_the_full_forward(params):
  tokens = _tokens((3, 14))
  full = np.asarray(models.logits(CFG, params, tokens))
  cache = models.init_cache(CFG, 3, 32)
  out, cache = models.decode(CFG, params, tokens[:, :5], np.tile(np.arange(5), (3, 1)), cache)
  steps = [np.asarray(out)]
  for t in range(5, 14):
    out, cache = models.decode(CFG, params, tokens[:, t:t + 1], np.full((3, 1), t), cache)
    steps.append(np.asarray(out))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-4, rtol=1e-5)


def test_sharded_over_eight_devices_equals_one(params):
  mesh = sharding.make_mesh(jax.devices()[:8], dict(data=1, fsdp=4, tensor=2))
  placed = jax.device_put(params, models.param_shardings(CFG, mesh))
  spec = placed["layer_0"]["mlp"]["experts_gate"].sharding.spec
  assert tuple(spec) == ("expert", "fsdp", "tensor")  # width over tensor, hidden over fsdp (expert=1 here)
  tokens = _tokens((4, 12))
  np.testing.assert_allclose(models.logits(CFG, placed, tokens, mesh=mesh),
                             models.logits(CFG, params, tokens), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shape,matmul", [
    (dict(fsdp=2, expert=4), "ragged"),
    (dict(expert=4, tensor=2), "dense"),
])
def test_expert_parallel_over_eight_devices_equals_one_values_and_gradients(params, shape, matmul):
  cfg = CFG.replace(moe_matmul=matmul)
  mesh = sharding.make_mesh(jax.devices()[:8], shape)
  placed = jax.device_put(params, models.param_shardings(cfg, mesh))
  gate = placed["layer_0"]["mlp"]["experts_gate"]
  assert gate.sharding.shard_shape(gate.shape)[0] == 8 // shape["expert"]  # each shard its experts
  tokens = _tokens((8, 12), seed=4)
  positions = np.tile(np.arange(12, dtype=np.int32), (8, 1))
  routes = np.random.default_rng(5).permuted(np.tile(np.arange(8), (8, 12, 2, 1)), axis=-1)[..., :2]

  def loss(p, m, replay):
    logits = models.apply_logits(cfg, p, tokens, positions, np.ones_like(tokens), m,
                                 routes_btlk=routes if replay else None)
    return jnp.sum(jnp.tanh(logits[..., :5]))

  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=(1, 2))
  for replay in (False, True):
    want, want_g = value_and_grad(params, None, replay)
    got, got_g = value_and_grad(placed, mesh, replay)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
      np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
  # the tokens did travel: the program exchanges them between the expert shards
  hlo = jax.jit(lambda p: models.logits(cfg, p, tokens, mesh=mesh)).lower(placed).as_text()
  assert "all_to_all" in hlo or "all-to-all" in hlo


def test_exchange_capacity_and_which_slots_it_keeps_by_hand():
  assert [moe.exchange_capacity(12, 4, c) for c in (0, 1, 1.25, 8)] == [12, 3, 4, 12]
  # per destination: valid slots first in slot order, then padding's; the first `capacity` kept
  keep = moe.capacity_keep(jnp.array([1, 0, 1, 1, 0]), jnp.array([True, True, False, True, True]), 1, 2)
  assert np.asarray(keep).tolist() == [True, True, False, False, False]
  keep = moe.capacity_keep(jnp.array([1, 0, 1, 1, 0]), jnp.array([False, True, True, True, True]), 2, 2)
  assert np.asarray(keep).tolist() == [False, True, True, True, True]


def _kept_by_numpy(experts_bnk, valid_bn, per_shard, shards, capacity):
  """The capacity rule written out: each batch row is one shard's tokens; per destination shard its
  valid slots in token order, then its padding's, the first `capacity` kept."""
  keep = np.zeros(experts_bnk.shape, bool)
  for row in range(experts_bnk.shape[0]):
    slots = [(t, j) for t in range(experts_bnk.shape[1]) for j in range(experts_bnk.shape[2])]
    for dest in range(shards):
      mine = [s for s in slots if experts_bnk[row][s] // per_shard == dest]
      ranked = [s for s in mine if valid_bn[row, s[0]]] + [s for s in mine if not valid_bn[row, s[0]]]
      for s in ranked[:capacity]:
        keep[row][s] = True
  return keep


@pytest.mark.parametrize("matmul", ["ragged", "dense"])
def test_a_capacity_bounded_exchange_drops_the_slots_past_it_and_only_those(matmul):
  """Experts over a 4-way expert axis (one batch row per shard), 8 experts, top 2, capacity factor 1
  (3 of a shard's 12 slots to each shard): values and gradients equal the one-device reference with
  the dropped slots' weights zeroed, the slots the numpy rule above drops, counted; the control: the
  dropless reference differs. An even routing under the same capacity drops nothing."""
  rng = np.random.default_rng(3)
  b, t, d, f, e, k, shards = 4, 6, 8, 6, 8, 2, 4
  mesh = sharding.make_mesh(jax.devices()[:4], dict(expert=shards))
  x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  skewed = np.stack([np.stack([rng.choice(3, size=k, replace=False) for _ in range(t)]) for _ in range(b)])
  skewed[1] = np.stack([rng.choice(8, size=k, replace=False) for _ in range(t)])
  # slot s = 2 token + j to shard s % 4: 3 slots to each shard from each
  even = np.array([[[2 * ((2 * i + j) % 4) + r % 2 for j in range(k)] for i in range(t)] for r in range(b)])
  weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(b, t, k)), jnp.float32)
  valid = np.ones((b, t), bool)
  valid[0, :2] = False  # padding: dropped before any valid slot
  w = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
  cap = moe.exchange_capacity(t * k, shards, 1.0)
  assert cap == 3

  def parallel(x, weights, *w, experts):
    return moe.experts_parallel(x, jnp.asarray(experts), weights, *w, mesh=mesh, matmul=matmul, exchange="padded",
                                valid_bt=jnp.asarray(valid), capacity_factor=1.0)

  def reference(x, weights, *w, experts, keep):
    y = moe.experts_dense(x.reshape(b * t, d), jnp.asarray(experts).reshape(b * t, k),
                          (weights * keep).reshape(b * t, k), *w)
    return y.reshape(b, t, d)

  for experts, drops in ((skewed, True), (even, False)):
    keep = _kept_by_numpy(experts, valid, e // shards, shards, cap)
    assert (~keep).any() == drops
    y, dropped = jax.jit(functools.partial(parallel, experts=experts))(x, weights, *w)
    want = reference(x, weights, *w, experts=experts, keep=keep)
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
    assert int(dropped) == int(np.sum(~keep & valid[..., None]))
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a) if fn is not parallel else fn(*a, experts=experts)[0]))
    got_g = jax.grad(loss(parallel), argnums=(0, 1, 2, 3, 4))(x, weights, *w)
    want_g = jax.grad(lambda *a: jnp.sum(jnp.sin(reference(*a, experts=experts, keep=keep))),
                      argnums=(0, 1, 2, 3, 4))(x, weights, *w)
    for a, c in zip(got_g, want_g):
      np.testing.assert_allclose(a, c, atol=1e-4, rtol=1e-4)
    dropless = reference(x, weights, *w, experts=experts, keep=np.ones_like(keep))
    assert (float(jnp.abs(y - dropless).max()) > 1e-2) == drops
  assert int(np.sum(~_kept_by_numpy(skewed, valid, 2, 4, cap) & valid[..., None])) > 3


def test_the_model_reports_what_the_capacity_dropped(params):
  """Through the model: the learner's MoE outputs carry the dropped share (0 dropless, > 0 with
  capacity 1 on a routing this uneven), and a capacity factor below 1 is refused by name."""
  mesh = sharding.make_mesh(jax.devices()[:4], dict(expert=4))
  tokens = _tokens((4, 12), seed=6)
  shares = []
  positions = np.tile(np.arange(12, dtype=np.int32), (4, 1))
  for c in (0.0, 1.0):
    cfg = CFG.replace(moe_capacity_factor=c)
    placed = jax.device_put(params, models.param_shardings(cfg, mesh))
    module = models.api._module(cfg, mesh)  # pylint: disable=protected-access
    with flax.linen.logical_axis_rules(sharding.LOGICAL_RULES):
      _, state = jax.jit(lambda p: module.apply({"params": p}, tokens, positions, np.ones_like(tokens),
                                                mutable=["moe"]))(placed)
    shares.append(float(models.moe_outputs(cfg, state).dropped))
  assert shares[0] == 0.0 and 0.0 < shares[1] < 1.0
  with pytest.raises(models.ModelConfigError, match="moe_capacity_factor=0.5"):
    CFG.replace(moe_capacity_factor=0.5)


def test_expert_parallel_refusals_name_the_problem(params):
  mesh = sharding.make_mesh(jax.devices()[:3], dict(expert=3))
  with pytest.raises(sharding.MeshError, match=r"experts_\w+.*dimension 8 does not divide over mesh axes"):
    sharding.check_divisible(models.abstract_params(CFG), models.param_shardings(CFG, mesh))
  with pytest.raises(models.ModelConfigError, match="moe_exchange='nccl'"):
    CFG.replace(moe_exchange="nccl")


def test_moe_config_errors_name_the_field():
  with pytest.raises(models.ModelConfigError, match="num_experts_per_tok=9 exceeds"):
    CFG.replace(num_experts_per_tok=9)
  with pytest.raises(models.ModelConfigError, match="moe_matmul='megablocks'"):
    CFG.replace(moe_matmul="megablocks")  # (the kernel is "megablox")
  with pytest.raises(models.ModelConfigError, match=r"mlp_only_layers=\[5\]"):
    CFG.replace(mlp_only_layers=(5,))
  with pytest.raises(models.ModelConfigError, match="every layer of this model is a mixture of experts"):
    CFG.replace(lora_rank=4)  # the default targets include the dense MLP's projections
  assert CFG.replace(lora_rank=4, lora_targets=("q", "v", "router")).lora


def test_int8_serving_quantizes_each_expert_per_output_channel(params):
  from asyncrl_jax.models import quant  # pylint: disable=import-outside-toplevel
  served = models.serving_params(CFG, params)
  q = quant.quantize(served)
  assert q["weights"]["layer_0"]["mlp"]["experts_gate"].dtype == jnp.int8
  assert q["scales"]["layer_0/mlp/experts_gate"].shape == (8, 1, 16)  # per expert and output channel
  assert q["scales"]["layer_0/mlp/experts_down"].shape == (8, 1, 32)
  assert q["weights"]["layer_0"]["mlp"]["router"].dtype == served["layer_0"]["mlp"]["router"].dtype
  assert quant.max_error(served, q) <= 0.5 + 1e-6
  # the control: one scale per output channel shared by every expert (the dense kernels' rule applied
  # to [E, D, F]) is not each expert's own: some expert's channel would use a larger step
  w = np.abs(np.asarray(served["layer_0"]["mlp"]["experts_gate"], np.float32))
  assert np.any(w.max(axis=(0, 1)) / 127.0 > q["scales"]["layer_0/mlp/experts_gate"][:, 0, :].astype(np.float32) * 1.01)
  tokens = _tokens((2, 6))
  cache = models.init_cache(CFG, 2, 16)
  got, _ = models.decode(CFG, q, tokens, np.tile(np.arange(6), (2, 1)), cache)
  want, _ = models.decode(CFG, quant.dequantize(q, jnp.float32), tokens, np.tile(np.arange(6), (2, 1)),
                          models.init_cache(CFG, 2, 16))
  np.testing.assert_allclose(got, want, atol=1e-5)
  mesh = sharding.make_mesh(jax.devices()[:4], dict(data=1, fsdp=2, tensor=2))
  specs = quant.shardings(models.param_shardings(CFG, mesh), models.abstract_params(CFG))
  assert tuple(specs["scales"]["layer_0/mlp/experts_gate"].spec) == ("expert", None, "tensor")


def test_lora_on_a_moe_model_targets_attention_and_the_router(params):
  from asyncrl_jax.models import lora  # pylint: disable=import-outside-toplevel
  cfg = CFG.replace(lora_rank=4, lora_targets=("q", "v", "router"))
  p = lora.add_adapters(cfg, params, jax.random.key(1))
  mlp = p["layer_0"]["mlp"]
  assert "router_lora_a" in mlp and "router_lora_b" in mlp
  assert not any(k.startswith("experts_") and "lora" in k for k in mlp)
  tokens = _tokens((2, 8))
  # new adapters (B = 0) change nothing; a trained router adapter moves the routing
  np.testing.assert_allclose(models.logits(cfg, p, tokens), models.logits(CFG, params, tokens), atol=1e-5)
  # (a B of equal columns would add one value to every expert's logit: no change under the softmax)
  moved = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 3.0 * jax.random.normal(jax.random.key(2), x.shape, x.dtype)
      if str(getattr(path[-1], "key", "")) == "router_lora_b" else x, p)
  _, r0, _, _ = models.logits_and_routes(cfg, p, tokens)
  _, r1, _, _ = models.logits_and_routes(cfg, moved, tokens)
  assert np.any(np.asarray(r0) != np.asarray(r1))
  with pytest.raises(ValueError, match="PEFT cannot put"):
    models.export_peft(cfg, moved, "/nonexistent", base_model="base")
  merged_cfg, merged = lora.merge(cfg, moved)
  np.testing.assert_allclose(models.logits(merged_cfg, merged, tokens), models.logits(cfg, moved, tokens),
                             atol=1e-4)
