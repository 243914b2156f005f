"""The memory estimate against XLA's own accounting of the compiled steps, and its arithmetic.

XLA's figure for the learner is what its gradient step holds at once: the step's arguments (parameters,
micro-batch), outputs (gradients), temporaries (activations), plus what lives beside it between steps
(AdamW's moments and the running gradient sum). For a decode server it is the larger of the decode
step and a re-prefill of every slot: arguments + outputs - donated (aliased) + temporaries.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax import models

from asyncrl_jax.infra import bucketing

from asyncrl_jax.tpu import chips, memory

from asyncrl_jax import config as config_lib
from asyncrl_jax.infra import sharding
from asyncrl_jax.learner.updater import make_optimizer
from asyncrl_jax.rl.batching import TokenBatch
from asyncrl_jax.rl.objective import LossSettings, micro_batch_loss
from asyncrl_jax.rollout.engine import Engine


def _bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _small(name: str, vocab_chunk: int = 0, attention_chunk: int = 0):
  c = config_lib.base_config()
  if name == "narrow":
    c.model.update(vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                   num_kv_heads=2, max_seq_len=256)
    c.learner.update(token_budget=1024)
    c.rollout.update(num_slots=16)
    c.data.update(max_prompt_len=32, max_completion_len=96)
  else:  # wider, deeper, a larger vocabulary
    c.model.update(vocab_size=4096, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=8,
                   num_kv_heads=2, max_seq_len=512)
    c.learner.update(token_budget=2048)
    c.rollout.update(num_slots=32)
    c.data.update(max_prompt_len=64, max_completion_len=192)
  c.learner.update(vocab_chunk=vocab_chunk, attention_chunk=attention_chunk)
  c.rollout.attention_chunk = attention_chunk
  return config_lib.validate(c)


def _one_device_mesh():
  return sharding.make_mesh(jax.devices()[:1], dict(data=1, fsdp=1, tensor=1))


def _xla_learner(config, m) -> int:
  params = jax.eval_shape(lambda: models.init_params(m, jax.random.key(0)))
  opt = jax.eval_shape(make_optimizer(learning_rate=1e-3, total_steps=10, grad_clip=1.0).init, params)
  width = bucketing.bucket(min(config.learner.token_budget, m.max_seq_len), bucketing.ROW_BUCKETS)
  ints = jax.ShapeDtypeStruct((config.learner.token_budget // width, width), jnp.int32)
  floats = jax.ShapeDtypeStruct(ints.shape, jnp.float32)
  batch = TokenBatch(ints, ints, ints, floats, floats, floats, ints, floats, floats)
  loss = functools.partial(micro_batch_loss, model=m, settings=LossSettings.from_config(config),
                           prox_is_current=True)
  grad = jax.jit(jax.value_and_grad(lambda p, b, n: loss(p, b, None, n), has_aux=True))
  stats = grad.lower(params, batch, jax.ShapeDtypeStruct((), jnp.float32)).compile().memory_analysis()
  step = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
  return step + _bytes(opt) + _bytes(params)


def _xla_decode_server(config, m) -> int:
  length = config.data.max_prompt_len + config.data.max_completion_len
  engine = Engine(m, mesh=_one_device_mesh(), num_slots=config.rollout.num_slots,
                  max_prefill_length=config.data.max_prompt_len, max_target_length=length,
                  background_compile=False, attention_chunk=config.rollout.attention_chunk)
  params = engine.param_spec()  # in the serving dtypes
  state = jax.eval_shape(engine.init_decode_state)
  slots = jax.ShapeDtypeStruct((config.rollout.num_slots,), jnp.int32)
  tokens = jax.ShapeDtypeStruct((config.rollout.num_slots, length), jnp.int32)
  held = lambda s: (s.argument_size_in_bytes + s.output_size_in_bytes - s.alias_size_in_bytes
                    + s.temp_size_in_bytes)
  step = engine._jit_step.lower(params, state).compile().memory_analysis()  # pylint: disable=protected-access
  refill = engine._jit_refill.lower(params, state, tokens, slots, slots).compile().memory_analysis()  # pylint: disable=protected-access
  return max(held(step), held(refill))


@pytest.mark.slow(25)
@pytest.mark.parametrize("name,vocab_chunk,attention_chunk",
                         [("narrow", 0, 0), ("wide", 256, 0), ("wide", 256, 64)])
def test_the_learner_estimate_is_within_20_percent_of_xla(name, vocab_chunk, attention_chunk):
  config = _small(name, vocab_chunk, attention_chunk)
  m = config_lib.model_config(config)
  estimate = memory.learner(config, m, devices=1)
  # (one step's program: the version's other micro-batches are arguments it does not see)
  step = estimate.total - estimate.terms["version batch (every trajectory full length)"]
  assert 0.8 <= step / _xla_learner(config, m) <= 1.2
  assert estimate.terms["activations"] > 0.3 * estimate.total  # not a comparison of parameter counts


@pytest.mark.parametrize("name,attention_chunk", [("narrow", 0), ("wide", 0), ("wide", 32)])
def test_the_decode_server_estimate_is_within_20_percent_of_xla(name, attention_chunk):
  config = _small(name, attention_chunk=attention_chunk)
  m = config_lib.model_config(config)
  estimate = memory.decode_server(config, m, devices=1)
  assert 0.8 <= estimate.total / _xla_decode_server(config, m) <= 1.2


def _xla_evaluation(config, m) -> int:
  """The held-out evaluation's larger call (``generate``, sampled when it samples): its arguments
  (the parameter copy, the prompts), outputs and temporaries (KV cache, prefill, decode steps)."""
  from asyncrl_jax.models.generate import generate  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.models.sampling import SamplingSettings  # pylint: disable=import-outside-toplevel
  samples = config.data.eval_samples
  rows = config.data.eval_problems * max(samples, 1)
  params = jax.eval_shape(lambda: models.init_params(m, jax.random.key(0)))
  prompts = jax.ShapeDtypeStruct((rows, config.data.max_prompt_len), jnp.int32)
  lengths = jax.ShapeDtypeStruct((rows,), jnp.int32)
  kwargs = dict(max_new_tokens=config.data.max_completion_len, eos_id=1)
  if samples:
    kwargs.update(settings=SamplingSettings(temperature=1.0))
  lowered = generate.lower(m, params, prompts, lengths, jax.random.key(0) if samples else None, **kwargs)
  s = lowered.compile().memory_analysis()
  return s.argument_size_in_bytes + s.output_size_in_bytes + s.temp_size_in_bytes


@pytest.mark.parametrize("name,samples", [("narrow", 0), ("narrow", 4), ("wide", 0), ("wide", 4)])
def test_the_evaluation_estimate_is_within_20_percent_of_xla(name, samples):
  config = _small(name)
  config.data.update(eval_problems=24, eval_samples=samples)
  m = config_lib.model_config(config)
  estimate = memory.evaluation(config, m, devices=1)
  resident = estimate.terms["parameters and AdamW moments (resident)"]
  assert resident == pytest.approx(3 * memory.learner(config, m, 1).terms["parameters"])
  assert 0.8 <= (estimate.total - resident) / _xla_evaluation(config, m) <= 1.2
  assert estimate.terms["KV cache"] > 0.1 * estimate.total  # not a comparison of parameter counts


@pytest.mark.parametrize("tie,bias", [(False, True), (True, True), (True, False)])
def test_the_parameter_count_is_the_models(tie, bias):
  m = models.ModelConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=6,
                         num_kv_heads=2, head_dim=16, qkv_bias=bias, tie_embeddings=tie)
  assert m.num_params == models.count_params(
      jax.eval_shape(lambda: models.init_params(m, jax.random.key(0))))


def test_a_mixture_of_experts_counts_every_expert_in_memory_and_its_active_ones_in_flops():
  from asyncrl_jax.tpu import projection  # pylint: disable=import-outside-toplevel
  dense = models.ModelConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_layers=3,
                             num_heads=6, num_kv_heads=2, head_dim=16, qkv_bias=False, qk_norm=True)
  m = dense.replace(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=(0,))
  assert m.num_params == models.count_params(jax.eval_shape(lambda: models.init_params(m, jax.random.key(0))))
  # layers 1 and 2: a router (48 x 8) and 8 experts of 3 x 48 x 24 each, 2 of them active per token
  assert m.num_params - m.num_active_params == 2 * 6 * 3 * 48 * 24
  moe_matrix = m.num_active_params - 300 * 48
  assert projection.model_flops_per_token(m, 0.0) == pytest.approx(6.0 * moe_matrix)
  assert projection.model_flops_per_token(dense, 0.0) == pytest.approx(6.0 * (dense.num_params - 300 * 48))


def test_the_exchange_buffers_shrink_to_the_capacity_by_hand():
  """Per token, with 4 expert shards and top 2: the router's 8 scores, the 2 slots' inputs and outputs
  (2 x 2 x 48), and over the rows a shard receives (dropless 4 x 2 = 8; capacity factor 1.5: 3) the
  experts' 4 intermediates of width 24 and the exchange's 3 buffers of width 48."""
  m = models.ModelConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=6,
                         num_kv_heads=2, head_dim=16, qkv_bias=False, qk_norm=True, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=(0,))
  fixed = 3 * 8 + 2 * 2 * 48
  assert memory.mlp_per_token(m, 1, 4) == fixed + 8 * 4 * 24 + 3 * 8 * 48
  assert memory.mlp_per_token(m.replace(moe_capacity_factor=1.5), 1, 4) == fixed + 3 * 4 * 24 + 3 * 3 * 48
  assert memory.mlp_per_token(m.replace(moe_capacity_factor=8.0), 1, 4) == memory.mlp_per_token(m, 1, 4)
  assert memory.mlp_per_token(m.replace(moe_capacity_factor=1.5), 1, 1) == memory.mlp_per_token(m, 1, 1)


def test_the_expert_axis_splits_the_experts_and_the_rows_and_a_mesh_that_cannot_is_refused():
  config = _small("narrow")
  config.model.update(qkv_bias=False, qk_norm=True)
  config.model.moe.update(num_experts=8, top_k=2, intermediate_size=16)
  m = config_lib.model_config(config)
  config.mesh.learner.update(data=1, fsdp=2, expert=1, tensor=1)
  two = memory.learner(config, m, 2).terms
  config.mesh.learner.update(data=1, fsdp=2, expert=4, tensor=1)
  eight = memory.learner(config, m, 8).terms
  p = 4  # float32 parameters
  rest = (m.num_params - m.num_expert_params) / 2 * p
  assert two["parameters"] == pytest.approx(rest + m.num_expert_params / 2 * p)
  assert eight["parameters"] == pytest.approx(rest + m.num_expert_params / 8 * p)  # experts over 4 more
  assert eight["optimizer (AdamW mu, nu)"] == pytest.approx(2 * eight["parameters"])
  # rows over data x fsdp x expert: the version batch per device is a quarter
  batch = "version batch (every trajectory full length)"
  assert eight[batch] == pytest.approx(two[batch] / 4, rel=0.05)
  for axes, devices, message in [
      (dict(data=1, fsdp=1, expert=3, tensor=1), 3, "expert=3: the model's 8 experts do not split"),
      (dict(data=1, fsdp=1, expert=2, tensor=1), 3, "does not fit 3 chips"),
      (dict(data=1, fsdp=1, expert=1, tensor=4), 4, "tensor=4: the model's 2 kv heads")]:
    with pytest.raises(ValueError, match=message):
      memory.check_mesh(m, axes, devices, "mesh.learner")
  with pytest.raises(ValueError, match="has no experts"):
    memory.check_mesh(m.replace(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0),
                      dict(expert=2), 2, "mesh.learner")


def test_the_version_batch_counts_recorded_routes():
  config = _small("narrow")
  config.data.update(max_prompt_len=64, max_completion_len=192)
  config.learner.update(batch_size=10, ppo_minibatches=1, token_budget=1024)
  config.rl.update(group_size=2, loss="ppo")
  config.mesh.learner.update(data=1, fsdp=2, tensor=1)
  config.model.update(qkv_bias=False, qk_norm=True)
  config.model.moe.update(num_experts=8, top_k=2, intermediate_size=16)
  m = config_lib.model_config(config)
  batch = "version batch (every trajectory full length)"
  without = memory.learner(config, m, 2).terms[batch]
  config.rollout.record_routes = True
  slots = without / 36  # token slots per device (nine 4-byte fields each)
  # int16 routes: 2 bytes x num_layers MoE layers x 2 experts per token slot
  assert memory.learner(config, m, 2).terms[batch] == pytest.approx(without + slots * 2 * m.num_layers * 2)


def test_terms_split_over_the_mesh_by_hand():
  config = _small("wide")
  m = config_lib.model_config(config)
  config.mesh.learner.update(data=1, fsdp=1, tensor=1)
  one = memory.learner(config, m, 1)
  config.mesh.learner.update(data=1, fsdp=-1, tensor=2)
  eight = memory.learner(config, m, 8)
  with pytest.raises(ValueError, match="does not fit 7 devices"):
    memory.learner(config, m, 7)
  # fsdp resolves to 4: parameters over fsdp x tensor = 8 ways, rows over fsdp = 4 ways
  assert eight.terms["parameters"] == pytest.approx(one.terms["parameters"] / 8)
  assert eight.terms["log-softmax"] == pytest.approx(one.terms["log-softmax"] / 8)  # rows / 4, vocab / 2
  # a KV cache by hand: 2 x layers x slots x length x kv heads x head dim x 4 bytes
  server = memory.decode_server(config, m, 1)
  assert server.terms["KV cache"] == 2 * 4 * 32 * 256 * 2 * 16 * 4


def test_the_version_batch_by_hand():
  """10 trajectories of 64 + 192 = 256 tokens in 2 minibatches of 5, under a 1024-token budget: rows
  of 256, 4 rows per micro-batch, so each minibatch is 2 micro-batches of 4 rows (the second padded),
  split over fsdp=2: 2 x 2 x 256 = 1024 token slots per device each. A slot holds the batch's nine
  4-byte fields, the second minibatch's also a prox log-prob (decoupled PPO only), and in value mode
  the critic's returns and values."""
  config = _small("narrow")
  config.data.update(max_prompt_len=64, max_completion_len=192)
  config.learner.update(batch_size=10, ppo_minibatches=2, token_budget=1024)
  config.rl.group_size = 2
  config.mesh.learner.update(data=1, fsdp=2, tensor=1)
  m = config_lib.model_config(config)
  batch = "version batch (every trajectory full length)"
  assert memory.learner(config, m, 2).terms[batch] == 1024 * 36 + 1024 * (36 + 4)
  config.rl.loss = "ppo"  # no prox pass
  assert memory.learner(config, m, 2).terms[batch] == 2 * 1024 * 36
  config.rl.update(loss="dis", advantage="value", group_size=1)
  assert memory.learner(config, m, 2).terms[batch] == 2 * 1024 * (36 + 8)


def test_the_critic_is_counted_in_value_mode():
  config = _small("wide")
  m = config_lib.model_config(config)
  config.mesh.learner.update(data=1, fsdp=2, tensor=2)
  group, evaluation = memory.learner(config, m, 4), memory.evaluation(config, m, 4)
  config.rl.update(advantage="value", group_size=1)
  value, value_evaluation = memory.learner(config, m, 4), memory.evaluation(config, m, 4)
  # a second trunk (split 4 ways) and a replicated head of hidden + 1, with AdamW's two moments, float32
  by_hand = 3 * (m.num_params / 4 + 128 + 1) * 4
  batch = "version batch (every trajectory full length)"
  assert (value.total - value.terms[batch]) - (group.total - group.terms[batch]) == pytest.approx(by_hand)
  assert value_evaluation.total - evaluation.total == pytest.approx(3 * m.num_params / 4 * 4)


def test_accelerator_names():
  kinds = lambda acc: (chips.parse(acc)[0].kind, chips.parse(acc)[1])
  assert kinds("v5p-8") == ("v5p", 4) and kinds("v6e-16") == ("v6e", 16)
  assert kinds("v5litepod-8") == ("v5e", 8) and kinds("v4-32") == ("v4", 16)
  with pytest.raises(ValueError, match="'v9x-8'"):
    chips.parse("v9x-8")
  ok, share = memory.fits(memory.RoleMemory("learner", 1, {"x": 76 * memory.GiB}), "v5p-8", margin=0.2)
  assert ok and share == pytest.approx(0.8)
  assert not memory.fits(memory.RoleMemory("learner", 1, {"x": 77 * memory.GiB}), "v5p-8", margin=0.2)[0]


def test_info_reports_each_role_and_whether_it_fits():
  from asyncrl_jax.tools import info  # pylint: disable=import-outside-toplevel
  lines, ok = info.memory_report(_small("wide"), "v5p-8")
  assert ok and sum("fits one v5p-8 chip" in l for l in lines) == 3
  assert any(l.startswith("learner memory per device (4 devices)") for l in lines)
  # held-out evaluation runs on the learner's chips (the decode servers are other hosts): its own table
  assert any(l.startswith("held-out evaluation (on the learner's devices) memory per device (4 devices)")
             for l in lines)
  # a run that decodes in its own process is told the tables do not describe it
  assert any("with rollout.servers=0" in l for l in lines)
  remote = _small("wide")
  remote.rollout.servers = 2
  assert not any("rollout.servers=0" in l for l in info.memory_report(remote, "v5p-8")[0])
  quiet = _small("wide")
  quiet.learner.eval_every = 0
  lines, ok = info.memory_report(quiet, "v5p-8")
  assert ok and not any(l.startswith("held-out evaluation") for l in lines)
  big = _small("wide")
  big.learner.token_budget = 2**22  # 8192 rows of 512: over 200 GiB of attention per device
  lines, ok = info.memory_report(big, "v5p-8", "v6e-8")
  assert not ok and any("DOES NOT FIT one v5p-8 chip" in l for l in lines)
  assert any("decode server memory per device (8 devices)" in l for l in lines)


def _shipped_configs():
  import glob  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
  for path in sorted(glob.glob(os.path.join(root, "*.py"))):
    module = config_lib.config_module(path)
    if hasattr(module, "ACCELERATORS"):
      yield os.path.basename(path), module


def test_every_shipped_accelerator_config_fits_with_the_margin_its_docstring_states():
  from asyncrl_jax.tools import info  # pylint: disable=import-outside-toplevel
  shipped = list(_shipped_configs())
  assert {name for name, _ in shipped} >= {"qwen2_5_1_5b.py", "qwen2_5_1_5b_v6e.py",
                                           "r1_distill_qwen_7b_v5p.py"}
  for name, module in shipped:
    acc = module.ACCELERATORS
    config = config_lib.validate(module.get_config())
    lines, ok = info.memory_report(config, acc["learner"], acc["rollout"], acc["margin"])
    assert ok, (name, lines)
    assert f"with {acc['margin']:.0%} of HBM to spare" in " ".join(module.__doc__.split()), name
    # every learner chip holds whole rows: the token budget is a multiple of the rows' width per chip
    _, n_chips = chips.parse(acc["learner"])
    assert config.learner.token_budget % n_chips == 0, name
    assert config.rl.max_staleness == 4 and config.learner.batch_size == 512 * 16, name


def test_the_planner_searches_every_slice_of_a_config_with_replicas():
  """A learner mesh with data=2 does not fit a 1-chip slice: the planner sizes such slices with
  FSDP over all their chips instead of failing (the v6e config on its 64 chips)."""
  from asyncrl_jax.tpu import projection  # pylint: disable=import-outside-toplevel
  module = dict(_shipped_configs())["qwen2_5_1_5b_v6e.py"]
  config = config_lib.validate(module.get_config())
  assert int(config.mesh.learner.data) == 2
  with pytest.raises(ValueError, match="does not fit 1 devices"):  # the negative control
    memory.learner(config, models.config_of(config), 1)
  plan = projection.plan_split(config, models.config_of(config), kind="v6e", total_chips=64,
                               server_chips=8, learner_chips=16, decode_tok_s_per_chip=1000.0,
                               train_tok_s_per_chip=5000.0, slots_per_chip=16, etas=(0, 4), epochs=2)
  sizes = {c["learner_chips"] for c in plan["candidates"]}
  assert 1 in sizes and 16 in sizes, sizes
