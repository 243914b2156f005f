"""How much device memory a run needs, per device of each role, before anything is compiled.

``learner``, ``decode_server`` and ``evaluation`` each return a ``RoleMemory`` table of named
terms in bytes:

* learner (per device of the learner mesh): parameters, AdamW's two moments, gradients (the running
  sum over micro-batches and the current micro-batch's), and the activations one micro-batch of
  ``learner.token_budget`` tokens keeps for its backward pass: per block its inputs and intermediates
  and the attention probabilities ``[rows, heads, width, width]``, and the log-softmax's logits
  ``[tokens, V]`` (or one ``learner.vocab_chunk`` of them). With ``learner.remat`` a block keeps only
  its input, and one block at a time is live in full; with ``learner.attention_chunk`` the scores of
  one block of queries are live at a time, and none are kept. With ``rl.advantage="value"`` the
  critic's parameters and AdamW moments too (its updates take turns with the policy's). And the
  version's batch: all its packed micro-batches are placed before its first update, counted at the
  most a version can hold (``learner.batch_size`` trajectories, every one full length).
* decode server (per device of one server's mesh): parameters, the KV cache (``2 x layers x slots x
  (prompt + completion) x kv_heads x head_dim``), the decode state's next-token logits, one decode
  step's intermediates, and the largest prefill call's (a re-prefill after a weight update may refill
  every slot at full length, in calls of at most ``rollout.prefill_tokens`` tokens).
* held-out evaluation (``evaluation``; per device of the learner mesh, where it runs when the decode
  servers are other hosts): the learner's resident state, a parameter copy, the evaluation's KV cache
  and its largest step.

Parameters and optimizer state are split over ``fsdp x tensor`` (a mixture of experts' experts also
over ``expert``), rows over ``data x fsdp x expert``, heads and the MLP width over ``tensor``. A
mixture-of-experts layer keeps, per token, its k experts' intermediates, and with expert parallelism
(``expert`` > 1) the exchange's buffers, sized for the dropless worst case (``models.moe``: a shard may
receive ``expert x k`` rows per local token; ``c x k`` under ``model.moe.capacity_factor`` c), and its experts' intermediates over those rows. The terms count the buffers a step's program holds at its peak; XLA may
fuse some away or keep a few copies more (``tests/tpu/test_memory.py`` compares the totals with XLA's own
``compile().memory_analysis()`` on CPU). ``tpu.chips.CHIPS`` lists HBM per chip, so that
``python -m asyncrl_jax info --config=... --accelerator=v5p-8`` says whether each role fits.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

from asyncrl_jax.infra import bucketing
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.models.forward import Forward
from asyncrl_jax.tpu import chips as chips_lib

GiB = 2**30

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass
class RoleMemory:
  """Named terms in bytes per device, and the device count they were computed for."""
  role: str
  devices: int
  terms: dict

  @property
  def total(self) -> int:
    return int(sum(self.terms.values()))

  def lines(self) -> list[str]:
    width = max(len(k) for k in self.terms)
    out = [f"{self.role} memory per device ({self.devices} devices):"]
    out += [f"  {k:<{width}}  {v / GiB:9.3f} GiB" for k, v in self.terms.items()]
    out.append(f"  {'total':<{width}}  {self.total / GiB:9.3f} GiB")
    return out


class MeshSizes(NamedTuple):
  """A role's mesh axis sizes; ``rows``: the ways rows are split (data x fsdp x expert)."""
  data: int
  fsdp: int
  tensor: int
  expert: int

  @property
  def rows(self) -> int:
    return self.data * self.fsdp * self.expert


def mesh_sizes(axes, devices: int) -> MeshSizes:
  """The axis sizes with ``-1`` resolved against ``devices`` (an axis left out: 1)."""
  sizes = {k: int(axes.get(k, 1)) for k in ("data", "fsdp", "tensor", "expert")}
  known = math.prod(v for v in sizes.values() if v != -1)
  for k, v in sizes.items():
    if v == -1:
      sizes[k] = max(devices // known, 1)
  if math.prod(sizes.values()) != devices:
    raise ValueError(f"mesh {dict(axes)} does not fit {devices} devices")
  return MeshSizes(**sizes)


def check_mesh(m: ModelConfig, axes, devices: int, role: str) -> MeshSizes:
  """``role``'s mesh sizes on ``devices``; ValueError naming the axis when the mesh does not fit the
  devices or the model: its experts over ``expert``, its (kv) heads over ``tensor``."""
  try:
    mesh = mesh_sizes(axes, devices)
  except ValueError:
    raise ValueError(f"{role}={dict(axes)} does not fit {devices} chips") from None
  if mesh.expert > 1 and (not m.num_experts or m.num_experts % mesh.expert):
    raise ValueError(f"{role}.expert={mesh.expert}: " + (
        f"the model's {m.num_experts} experts do not split over it" if m.num_experts else
        "the model has no experts (expert parallelism is for a mixture of experts)"))
  if m.num_kv_heads % mesh.tensor:
    raise ValueError(f"{role}.tensor={mesh.tensor}: the model's {m.num_kv_heads} kv heads do not "
                     "split over it")
  return mesh


def param_shard(m: ModelConfig, mesh: MeshSizes) -> float:
  """Parameters per device: the experts over fsdp x tensor x expert, the rest over fsdp x tensor."""
  return ((m.num_params - m.num_expert_params) / (mesh.fsdp * mesh.tensor)
          + m.num_expert_params / (mesh.fsdp * mesh.tensor * mesh.expert))


def mlp_per_token(m: ModelConfig, tensor: int, expert: int, *, backward: bool = True) -> float:
  """Elements per token of the largest MLP's intermediates (in the compute dtype): a dense SwiGLU's
  gate, up, silu(gate) and product (3 of them in a forward pass); a mixture of experts' router
  scores, the k slots' sorted inputs and outputs, and its experts' intermediates over the rows it
  computes: ``k`` per token on one shard, with expert parallelism ``expert x k`` (the dropless
  receive buffer; ``c x k`` under a capacity factor c; plus the send, receive and return buffers); the dense reference path every expert
  on every token."""
  n = 4 if backward else 3
  dense = n * m.intermediate_size / tensor if len(m.moe_layers) < m.num_layers else 0.0
  if not m.num_experts:
    return dense
  d, f, k, e = m.hidden_size, m.moe_intermediate_size / tensor, m.num_experts_per_tok, m.num_experts
  # rows a shard receives per local token: every slot of every shard (dropless), or the capacity's
  received = min(expert, m.moe_capacity_factor or expert) * k
  if m.moe_matmul == "dense":
    experts = (e / expert) * (n * f + d) * (received if expert > 1 else 1)
  else:
    experts = (received if expert > 1 else k) * n * f
  exchange = 3 * received * d if expert > 1 else 0.0
  return max(dense, 3 * e + 2 * k * d + experts + exchange)


def _block_activations(m: ModelConfig, tokens: float, rows: float, width: int, tensor: int,
                       chunk: int = 0, expert: int = 1) -> dict:
  """Bytes one block keeps for the backward pass of ``tokens`` tokens in ``rows`` rows of ``width``;
  with an attention ``chunk``, its attention term is one block of ``chunk`` queries, live only while
  that block is computed (each block is recomputed in the backward pass)."""
  a = _BYTES[m.dtype]
  heads, kv = m.num_heads / tensor, m.num_kv_heads / tensor
  per_token = (4 * m.hidden_size  # two norms' inputs and outputs
               + 3 * heads * m.head_dim + 4 * kv * m.head_dim  # q (and roped), k, v (and roped), output
               + mlp_per_token(m, tensor, expert))  # gate, up, silu(gate), their product (or the experts')
  # float32 scores, masked scores and probabilities, and the boolean mask broadcast over the heads
  queries = min(chunk, width) if chunk else width
  scores = rows * heads * queries * width * (3 * 4 + 1)
  return dict(residuals=tokens * per_token * a, attention=scores)


def learner(config, m: ModelConfig, devices: int) -> RoleMemory:
  """Per-device memory of the learner on ``devices`` devices (its mesh from ``config.mesh.learner``)."""
  mesh = mesh_sizes(config.mesh.learner, devices)
  fsdp, tensor = mesh.fsdp, mesh.tensor
  p = _BYTES[m.param_dtype]
  shard = param_shard(m, mesh)
  budget = int(config.learner.token_budget)
  width = bucketing.bucket(min(budget, m.max_seq_len), bucketing.ROW_BUCKETS)
  rows = -(-max(budget // width, 1) // mesh.rows)  # rows are padded to a multiple of data x fsdp x expert
  tokens = rows * width
  forward = Forward.from_learner(config)
  chunk = forward.attention_chunk
  block = _block_activations(m, tokens, rows, width, tensor, chunk, mesh.expert)
  if forward.attention == "splash":
    # scores stay on chip; the kernel keeps its output's log-sum-exp, and its fused backward pass
    # writes dq as float32 partial sums, one per key block, while one layer's backward runs
    from asyncrl_jax.models.attention import splash_block  # pylint: disable=import-outside-toplevel
    partials = width // splash_block(width) * width * m.head_dim * 4
    block["attention"] = rows * m.num_heads / tensor * (width * 4 + partials)
    chunk = width  # (live while one layer's attention runs, like a chunk's)
  per_layer = block["residuals"] + (0 if chunk else block["attention"])  # kept for the backward pass
  layer_input = tokens * m.hidden_size * _BYTES[m.dtype]
  if forward.remat in ("full", "minimal_offloaded"):  # (offloaded products live in host memory)
    kept = m.num_layers * layer_input + sum(block.values())
  elif forward.remat in ("minimal", "dots_saveable"):  # the weight products' outputs stay
    heads, kv = m.num_heads / tensor, m.num_kv_heads / tensor
    mlp = mlp_per_token(m, tensor, mesh.expert, backward=False)
    products = tokens * ((heads + 2 * kv) * m.head_dim + 2 * m.hidden_size + mlp) * _BYTES[m.dtype]
    scores = block["attention"] if forward.remat == "dots_saveable" and not chunk else 0
    kept = m.num_layers * (layer_input + products + scores) + sum(block.values())
  else:
    kept = m.num_layers * per_layer + (block["attention"] if chunk else 0)
  columns = int(config.learner.vocab_chunk) or m.vocab_size / tensor
  logits = 3 * tokens * columns * 4  # float32 logits, their softmax, its gradient
  # LoRA: the base is frozen, so only the adapters have gradients and optimizer state (they shard
  # like their projections, the rank axis replicated: about as evenly)
  trained = m.num_lora_params / (fsdp * tensor) if m.lora else shard
  terms = {
      "parameters": (shard + m.num_lora_params / (fsdp * tensor)) * p,
      "optimizer (AdamW mu, nu)": 2 * trained * p,
      "gradients (sum + micro-batch)": 2 * trained * p,
      "activations": kept,
      "log-softmax": logits,
  }
  if config.rl.advantage == "value":  # the critic: a second trunk (and a scalar head) with its own
    # AdamW, resident beside the policy; its updates take turns with the policy's (same activations)
    terms["value model (parameters, AdamW)"] = 3 * (shard + m.hidden_size + 1) * p
  terms["version batch (every trajectory full length)"] = version_batch(config, mesh.rows)
  return RoleMemory("learner", devices, terms)


def version_batch(config, row_shards: int) -> float:
  """Bytes per device of one version's packed micro-batches, all on device while the version trains:
  ``learner.batch_size`` trajectories of prompt + completion length each (the most a version can hold),
  in ``learner.ppo_minibatches`` parts packed as the learner packs them (``batching``), rows padded to
  a multiple of ``row_shards`` and split over them. Per token slot: the ``TokenBatch``'s 4-byte
  fields and, with recorded routes, 2 bytes per MoE layer and routed expert; the prox log-probs of every minibatch after the first; in value mode the critic's returns
  and values (its advantages replace the batch's)."""
  from asyncrl_jax.rl import batching, losses  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl.objective import corrections_from_config  # pylint: disable=import-outside-toplevel
  length = int(config.data.max_prompt_len) + int(config.data.max_completion_len)
  q, r = divmod(int(config.learner.batch_size), int(config.learner.ppo_minibatches))
  sizes = [q + (i < r) for i in range(int(config.learner.ppo_minibatches))]  # np.array_split's
  total = 0.0
  prox = losses.needs_prox(config.rl.loss, corrections_from_config(config))
  route_bytes = 0  # rollout.record_routes: int16 experts per token and MoE layer
  if config.rollout.get("record_routes"):
    from asyncrl_jax import models  # pylint: disable=import-outside-toplevel
    m = models.config_of(config)
    route_bytes = 2 * math.prod(m.route_shape)
  for i, n in enumerate(sizes):
    plan = batching.plan_micro_batches([length] * n, int(config.learner.token_budget))
    rows = -(-plan.rows // row_shards) * row_shards
    per_slot = ((len(batching.TokenBatch._fields) - 1) * 4 + (4 if i and prox else 0)
                + (8 if config.rl.advantage == "value" else 0) + route_bytes)
    total += len(plan.micro_batches) * rows / row_shards * plan.row_len * per_slot
  return total


def serving_bytes(m: ModelConfig) -> int:
  """Bytes per parameter on a decode server (``models.serving_dtypes``: the narrower of the compute
  and storage dtypes; the norm scales, a negligible share, as stored)."""
  return min(_BYTES[m.dtype], _BYTES[m.param_dtype])


def served_weight_bytes(config, m: ModelConfig) -> float:
  """Bytes of the weights a decode server holds: the serving dtype (``serving_bytes``), or with
  ``rollout.weight_dtype="int8"`` one byte per projection-kernel element plus a bfloat16 scale per
  output channel, the embedding, norms and adapters as served (``models.quant``)."""
  b = serving_bytes(m)
  if config.rollout.get("weight_dtype", "") != "int8":
    return (m.num_params + m.num_lora_params) * b
  d, f, h = m.hidden_size, m.intermediate_size, m.head_dim
  n_moe, n_dense = len(m.moe_layers), m.num_layers - len(m.moe_layers)
  kernels = m.num_layers * d * h * (2 * m.num_heads + 2 * m.num_kv_heads) + n_dense * 3 * d * f
  scales = m.num_layers * (h * (m.num_heads + 2 * m.num_kv_heads) + d) + n_dense * (2 * f + d)
  if n_moe:  # every expert per output channel (the router stays as served)
    kernels += n_moe * m.num_experts * 3 * d * m.moe_intermediate_size
    scales += n_moe * m.num_experts * (2 * m.moe_intermediate_size + d)
  if not m.tie_embeddings:  # the output projection is a kernel too
    kernels, scales = kernels + m.vocab_size * d, scales + m.vocab_size
  return kernels + 2 * scales + (m.num_params - kernels + m.num_lora_params) * b


def decode_server(config, m: ModelConfig, devices: int) -> RoleMemory:
  """Per-device memory of one decode server on ``devices`` devices (``config.mesh.rollout``)."""
  mesh = mesh_sizes(config.mesh.rollout, devices)
  fsdp, tensor = mesh.fsdp, mesh.tensor
  a = _BYTES[m.dtype]
  slots = -(-int(config.rollout.num_slots) // mesh.rows)
  length = int(config.data.max_prompt_len) + int(config.data.max_completion_len)
  kv = m.num_kv_heads / tensor
  cache = 2 * m.num_layers * slots * length * kv * m.head_dim * a
  heads = m.num_heads / tensor
  vocab = m.vocab_size / tensor
  step = slots * (3 * vocab * 4 + 3 * heads * length * 4)  # sampling's log-softmaxes; attention
  # One block at a time is live in a prefill (nothing is kept for a backward pass), and within it
  # either the attention (scores, or one block of them) or the MLP's three [tokens, F] intermediates.
  # The largest call: every slot at full length, or as many rows as rollout.prefill_tokens allows.
  from asyncrl_jax.rollout.prefill_plan import prefill_shapes  # pylint: disable=import-outside-toplevel
  shapes = prefill_shapes(int(config.rollout.num_slots), length, int(config.rollout.prefill_tokens))
  rows = -(-max(r for r, w in shapes if w == length) // mesh.rows)
  tokens = rows * length
  attention = _block_activations(m, tokens, rows, length, tensor,
                                 int(config.rollout.attention_chunk))["attention"]
  refill = max(attention, tokens * mlp_per_token(m, tensor, mesh.expert, backward=False) * a)
  refill += 2 * tokens * m.hidden_size * a  # the residual stream in and out of the block
  return RoleMemory("decode server", devices, {
      "parameters (serving dtype)": served_weight_bytes(config, m) * param_shard(m, mesh) / m.num_params,
      "KV cache": cache,
      "next-token logits": slots * vocab * 4,
      "largest re-prefill call (> a decode step)": max(step, refill),
  })


def evaluation(config, m: ModelConfig, devices: int) -> RoleMemory:
  """Per-device memory of the held-out evaluation where it runs on the learner's devices (decode
  servers on other hosts, ``learner.eval_every`` > 0), between two training steps: the learner's
  resident parameters and AdamW moments, the copy of the parameters it decodes with, the KV cache of
  its largest call (``data.eval_problems`` rows greedy, or x ``data.eval_samples`` sampled, and the
  same for the final evaluation's ``final_eval_*``, padded to a multiple of data x fsdp, each of
  prompt + completion length), and that call's largest step: the
  prompts' prefill (logits at one position per row; full attention, no chunking) or a decode step."""
  mesh = mesh_sizes(config.mesh.learner, devices)
  tensor = mesh.tensor
  a, p = _BYTES[m.dtype], _BYTES[m.param_dtype]
  problems, samples = int(config.data.eval_problems), int(config.data.eval_samples)
  final_problems = int(config.data.get("final_eval_problems", 0)) or problems
  final_samples = int(config.data.get("final_eval_samples", 0)) or samples
  sampling = float(config.rollout.temperature) > 0
  rows = -(-max(problems, problems * samples * sampling, final_problems,
                final_problems * final_samples * sampling) // mesh.rows)
  prompt = int(config.data.max_prompt_len)
  length = prompt + int(config.data.max_completion_len)
  shard = param_shard(m, mesh)
  cache = 2 * m.num_layers * rows * length * (m.num_kv_heads / tensor) * m.head_dim * a
  step = rows * (3 * m.vocab_size / tensor * 4 + 3 * m.num_heads / tensor * length * 4)
  tokens = rows * prompt
  attention = _block_activations(m, tokens, rows, prompt, tensor)["attention"]
  prefill = (max(attention, tokens * mlp_per_token(m, tensor, mesh.expert, backward=False) * a)
             + 2 * tokens * m.hidden_size * a)
  prefill += rows * m.vocab_size / tensor * 4  # the next-token logits it returns
  resident = 3 * shard * p * (2 if config.rl.advantage == "value" else 1)  # (and the critic's)
  return RoleMemory("held-out evaluation (on the learner's devices)", devices, {
      "parameters and AdamW moments (resident)": resident,
      "parameter copy it decodes with": shard * p,
      "KV cache": cache,
      "largest prefill or decode step": max(step, prefill),
  })


def fits(role: RoleMemory, accelerator: str, margin: float = 0.2) -> tuple[bool, float]:
  """Whether ``role`` fits one chip of ``accelerator`` with ``margin`` of its HBM to spare; and the
  share of HBM it uses."""
  chip, _ = chips_lib.parse(accelerator)
  share = role.total / chip.hbm_bytes
  return share <= 1 - margin, share


def program_estimates(config, m: ModelConfig, learner_devices: int, rollout_devices: int) -> dict:
  """Per role, program name (as ``Learner.programs`` and ``Engine.programs`` name them) -> the bytes
  per device this model expects the program to hold at its peak (arguments + outputs + temporaries -
  donated), for comparison with the TPU compiler's (``asyncrl_jax.tpu.compile``)."""
  return {"learner": _learner_programs(config, m, learner_devices),
          "rollout": _decode_programs(config, m, rollout_devices)}


def _learner_programs(config, m: ModelConfig, devices: int) -> dict:
  """A gradient step holds the parameters, its gradient (the output), the activations its backward
  pass keeps and the log-softmax's buffers, and its micro-batch; the prox pass (forward only) the
  parameters and the larger of one block's forward intermediates and the log-softmax's; the gradient
  sum two gradients (one donated); the optimizer step the parameters, AdamW's moments and the
  gradients (arguments; its outputs replace them) and the clipped gradients and updates it computes
  before the step is kept or dropped (about 1.5 parameter shards)."""
  t = learner(config, m, devices).terms
  mesh = mesh_sizes(config.mesh.learner, devices)
  fsdp, tensor = mesh.fsdp, mesh.tensor
  lora_shard = m.num_lora_params / (fsdp * tensor) * _BYTES[m.param_dtype]
  shard = param_shard(m, mesh) * _BYTES[m.param_dtype] + lora_shard
  # what has gradients and optimizer state: the adapters alone with LoRA
  trained = lora_shard if m.lora else param_shard(m, mesh) * _BYTES[m.param_dtype]
  budget = int(config.learner.token_budget)
  width = bucketing.bucket(min(budget, m.max_seq_len), bucketing.ROW_BUCKETS)
  rows = -(-max(budget // width, 1) // mesh.rows)
  tokens = rows * width
  micro_batch = tokens * 9 * 4  # the TokenBatch's nine 4-byte fields
  # (of the log-softmax's three [tokens, columns] float32 buffers, the TPU compiler's gradient step
  # holds two at its peak: the third is fused; its buffer report shows it)
  grad = t["parameters"] + trained + t["activations"] + t["log-softmax"] * 2 / 3 + micro_batch
  forward_options = Forward.from_learner(config)
  block = _block_activations(m, tokens, rows, width, tensor, forward_options.attention_chunk, mesh.expert)
  if forward_options.attention == "splash":  # a forward pass keeps no scores: the output's lse only
    block["attention"] = rows * m.num_heads / tensor * width * 4
  mlp = tokens * mlp_per_token(m, tensor, mesh.expert, backward=False) * _BYTES[m.dtype]
  forward = max(mlp, block["attention"], t["log-softmax"]) + 2 * tokens * m.hidden_size * _BYTES[m.dtype]
  prox = t["parameters"] + micro_batch + forward + tokens * 4
  out = {"grad_step[first]": grad, "grad_step[later]": grad + tokens * 4, "prox_pass": prox,
         "accumulate": 2 * trained, "apply": shard + 4.5 * trained}
  if config.rl.advantage == "value":
    out.update({"value_estimate": prox + 2 * tokens * 4, "value_grad_step[value]": grad + 2 * tokens * 4,
                "value_accumulate": 2 * shard, "value_apply": 5.5 * shard})
  return out


def _decode_programs(config, m: ModelConfig, devices: int) -> dict:
  """Every decode-server program holds the parameters (in their serving dtypes), the KV cache and the
  next-token logits (the decode state, donated and replaced); the decode chunk one step's
  intermediates on top (and a copy of the weights in the compute dtype where they are served in
  another), a prefill of
  ``rows x width`` one block's (its attention block or its MLP's intermediates) for its rows."""
  role = decode_server(config, m, devices).terms
  mesh = mesh_sizes(config.mesh.rollout, devices)
  tensor = mesh.tensor
  a = _BYTES[m.dtype]
  base = role["parameters (serving dtype)"] + role["KV cache"] + role["next-token logits"]
  slots = -(-int(config.rollout.num_slots) // mesh.rows)
  length = int(config.data.max_prompt_len) + int(config.data.max_completion_len)
  step = slots * (3 * m.vocab_size / tensor * 4 + 3 * m.num_heads / tensor * length * 4)
  from asyncrl_jax.rollout.prefill_plan import prefill_shapes  # pylint: disable=import-outside-toplevel
  # the compiler hoists the weights' cast to the compute dtype out of the chunk's loop: a copy of
  # the parameters in that dtype for the whole chunk (none when they are served in it)
  cast = (param_shard(m, mesh) * a) if serving_bytes(m) != a else 0.0
  out = {"decode_chunk[16 steps]": base + step + cast}
  chunk = int(config.rollout.attention_chunk)
  for name, max_len in (("prefill_insert", int(config.data.max_prompt_len)), ("refill", length)):
    for r, w in prefill_shapes(int(config.rollout.num_slots), max_len, int(config.rollout.prefill_tokens)):
      rows = -(-r // mesh.rows)
      tokens = rows * w
      attention = _block_activations(m, tokens, rows, w, tensor, chunk)["attention"]
      block = max(attention, tokens * mlp_per_token(m, tensor, mesh.expert, backward=False) * a)
      out[f"{name}[{r}x{w}]"] = base + block + 2 * tokens * m.hidden_size * a
  return out
