"""A JetStream engine (``jetstream.engine.engine_api.Engine``, google-jetstream 0.2.2) for our model.

The decode state holds fixed-shape slots: a KV cache ``[S, L, K, H]`` per layer, every slot's
next-token logits and position. One ``generate`` call samples one token for every slot from its stored
logits (the first token after a prefill comes from the prompt's last logits), runs the model on those
tokens and stores the new logits; jitted with the decode state donated (the cache updates in place).

Beyond the JetStream API, the RL decode server uses:

* ``step(params, state) -> (state, tokens [S], logp [S])``: a generate step that also returns the
  log-probability of every sampled token (JetStream 0.2.2's ``ResultTokens`` has no room for it);
* ``refill(params, state, tokens [S, P], lengths [S])``: recompute every slot's cache and next-token
  logits from its tokens so far under ``params``: the interrupt after a weight update. Slots are grouped
  by length (``prefill_plan``) so that short sequences are not padded to the longest one;
* ``extend(params, state, rows, slots, starts, budgets)``: append tokens (an environment's observation)
  to slots that keep their context, computing only the new tokens' keys and values (multi-turn
  episodes; JetStream's ``prefill(existing_prefix=...)`` does the same for one prompt), and
  ``park(state, slots)``: stop slots from decoding while their episodes wait for an environment.

Sampling keys belong to requests, not to slots or steps: the token at position ``p`` of a request
is drawn with ``fold_in(fold_in(fold_in(key(seed), stream[0]), stream[1]), p)``, where the request's
stream comes from its id (``sampling_stream``). A request's tokens therefore depend on its id, the
run's seed and the weights, never on which server, slot or step served it, or on what else was in
the batch: runs with several decode servers are reproducible, and a retried or resumed request
draws what it would have drawn.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asyncrl_jax import models
from asyncrl_jax.models import attention, quant
from asyncrl_jax.infra import sharding as sharding_lib
from asyncrl_jax.infra.bucketing import bounded_traces
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.models.sampling import SamplingSettings, ban_stop_tokens, sample
from asyncrl_jax.rollout.compile_cache import ShapedPrefill
from asyncrl_jax.rollout.extension import ContextExtension, Prefix, function
from asyncrl_jax.rollout.jetstream_compat import engine_api, tokenizer_pb2
from asyncrl_jax.rollout.jetstream_tokenizer import JetStreamTokenizer
from asyncrl_jax.rollout.prefill_plan import prefill_shapes
from asyncrl_jax.tokenization import Tokenizer, load_tokenizer, tokenizer_of


@struct.dataclass
class DecodeState:
  cache: Any  # the KV cache, [S, L, ...] per layer in the engine's ``cache_layout`` (``models.init_cache``)
  logits: jax.Array  # [S, V] next-token logits of each slot
  positions: jax.Array  # [S] where the next token goes (= tokens in the slot so far)
  generated: jax.Array  # [S] tokens generated since the slot was filled
  budget: jax.Array  # [S] tokens the slot may still generate; 0 = idle (finished or never filled)
  rng: jax.Array  # the run's sampling key (every server of a run has the same)
  streams: jax.Array  # [S, 2] int32 each slot's request's sampling stream (``sampling_stream``)
  min_left: jax.Array  # [S] tokens the slot must still generate before a stop token may be sampled
  # [S, L, L_moe, k] int16 with ``record_routes``: per cache position, the experts each MoE layer
  # chose in the last forward pass over the token there (written beside its keys and values)
  routes: Any = None


class Engine(ContextExtension, engine_api.Engine):
  """Our Flax decoder behind JetStream's Engine API, on one rollout mesh.

  Args:
    config: model configuration.
    mesh: the rollout mesh (slots are split over its data x fsdp x expert axes).
    num_slots: concurrent sequences S (a multiple of the mesh's data x fsdp x expert size).
    max_prefill_length: longest prompt (or prompt + tokens so far, on refill).
    max_target_length: cache length L: prompt plus completion.
    sampling: temperature / top-k / top-p and which log-prob to record.
    tokenizer: our tokenizer (``load_tokenizer(tokenizer_path)`` if None).
    tokenizer_path: recorded in ``get_tokenizer``; "" means the built-in tokenizer.
    params: parameters to return from ``load_params`` (else ``hf_path`` is loaded, else random init).
    hf_path: a Hugging Face checkpoint directory.
    seed: sampling seed.
    background_compile: compile the batched-prefill shapes (new prompts, re-prefill after a weight
      update) that a call wants in a background thread, using compiled ones meanwhile (False: compile
      each when first needed, blocking the caller).
    attention_chunk: prefills attend this many queries at a time (0: all at once).
    prefill_tokens: no batched-prefill call computes more tokens than this, unless it is one row (0:
      no cap); bounds a re-prefill's activation memory at long lengths.
    decode_attention: how a decode step attends to the cache: "xla" (every position, masked) or
      "ragged" (the paged kernel reading each slot's positions up to its own on a TPU; elsewhere its
      XLA stand-in, for tests: ``models.attention.ragged_decode``).
    weight_dtype: "" holds the weights in the serving dtypes (``models.serving_dtypes``); "int8"
      quantizes each projection kernel per output channel when weights arrive (``models.quant``), and
      every program dequantizes them as it reads them: the behaviour log-probs recorded are those of
      the int8 model that sampled.
    record_routes: (a mixture-of-experts model) keep, per slot and cache position, the experts each
      MoE layer chose for the token there (``DecodeState.routes``; a re-prefill overwrites them like
      the keys and values), for the learner's routing replay (``slot_routes``). The JetStream
      ``prefill`` / ``insert`` path does not record them.
  """

  def __init__(self, config: ModelConfig, *, mesh: Mesh, num_slots: int, max_prefill_length: int,
               max_target_length: int, sampling: SamplingSettings = SamplingSettings(),
               tokenizer: Optional[Tokenizer] = None, tokenizer_path: str = "", params=None,
               hf_path: str = "", seed: int = 0, background_compile: bool = True,
               attention_chunk: int = 0, prefill_tokens: int = 0, decode_attention: str = "xla",
               stream_salt: str = "", weight_dtype: str = "", record_routes: bool = False):
    attention.check_decode_attention(decode_attention, head_dim=config.head_dim,
                                     platform=mesh.devices.flat[0].platform, cache_len=max_target_length)
    if max_target_length > config.max_seq_len:
      raise ValueError(f"max_target_length={max_target_length} exceeds model.max_seq_len="
                       f"{config.max_seq_len}")
    if max_prefill_length > max_target_length:
      raise ValueError(f"max_prefill_length={max_prefill_length} exceeds max_target_length="
                       f"{max_target_length}")
    batch_ways = sharding_lib.batch_ways(mesh)
    if num_slots % batch_ways:
      raise ValueError(f"num_slots={num_slots} must be a multiple of the rollout mesh's data x fsdp x expert "
                       f"size {batch_ways}")
    if record_routes and not config.moe:
      raise ValueError("rollout.record_routes=True needs a mixture-of-experts model (model.num_experts > 0)")
    self.config = config
    self.record_routes = record_routes
    self.attention_chunk = attention_chunk
    self.decode_attention = decode_attention
    self.cache_layout = models.cache_layout(decode_attention)  # what the decode step reads
    self._mesh = mesh
    self.num_slots = num_slots
    self._max_prefill = max_prefill_length
    self.max_target_length = max_target_length
    self.sampling = sampling
    self.tokenizer = tokenizer or load_tokenizer(tokenizer_path)
    self._stop_ids = np.asarray(sorted(self.tokenizer.stop_ids), np.int32)
    self.tokenizer_path = tokenizer_path
    self._params, self._hf_path, self._seed = params, hf_path, seed
    # requests inserted without a stream (JetStream's insert) get f"{salt}#{n}": distinct per engine
    # when each server process passes its own salt
    self._stream_salt, self._default_streams = stream_salt, itertools.count()
    self.param_shardings = models.param_shardings(config, mesh)  # of the weights as they arrive
    models.serving_dtypes(config)  # traced here, once: not later on the decode loop's guarded thread
    self.weight_dtype = quant.check_weight_dtype(weight_dtype)
    # of the weights the programs take: int8 kernels (and their scales) where the kernels are
    self.served_shardings = (quant.shardings(self.param_shardings, models.abstract_params(config))
                             if weight_dtype == "int8" else self.param_shardings)
    self._jit_quantize = (jax.jit(quant.quantize, out_shardings=self.served_shardings)
                          if weight_dtype == "int8" else None)
    self._slot_sharding = sharding_lib.batch_sharding(mesh, 1)
    self._replicated = sharding_lib.replicated(mesh)
    self._make_state = None
    self._jit_slot_routes = None
    self._jit_prefill = jax.jit(self._prefill_impl, static_argnums=(2,))
    self._jit_insert = jax.jit(self._insert_impl, donate_argnums=(1,))
    self._jit_step = jax.jit(self._step_impl, donate_argnums=(1,))
    self._jit_steps = {}  # max_steps -> the fused decode chunk, traced once
    # Each batched prefill traces once per (rows, width) shape its bucketing allows, and no more.
    # Explicit placement of the hot paths: params on their shardings, the decode state on its own
    # (donated: each call replaces it), host-made rows replicated.
    state = self._state_shardings()
    self._jit_prefill_insert = jax.jit(bounded_traces(
        function(self._prefill_insert_impl), "prefill_insert",
        len(prefill_shapes(num_slots, max_prefill_length, prefill_tokens))), donate_argnums=(1,),
        in_shardings=(self.served_shardings, state) + (self._replicated,) * 7, out_shardings=state)
    self._jit_refill = jax.jit(bounded_traces(
        function(self._refill_impl), "refill",
        len(prefill_shapes(num_slots, max_target_length, prefill_tokens))),
        donate_argnums=(1,), in_shardings=(self.served_shardings, state) + (self._replicated,) * 3,
        out_shardings=state)
    self._set_up_extension(batch_ways, state)
    self.prefill_call_overhead = 256  # tokens one more prefill call is worth (see prefill_plan)
    self._prefill_insert_calls = ShapedPrefill(self._jit_prefill_insert, "prefill_insert", num_slots,
                                                max_prefill_length, background_compile,
                                                sharding=self._replicated, max_tokens=prefill_tokens)
    self._refill_calls = ShapedPrefill(self._jit_refill, "refill", num_slots, max_target_length,
                                        background_compile, sharding=self._replicated,
                                        max_tokens=prefill_tokens)

  # ------------------------------------------------------------------ JetStream API: properties

  @property
  def max_concurrent_decodes(self) -> int:
    return self.num_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def colocated_cpus(self):
    return None

  # ------------------------------------------------------------------ JetStream API: methods

  def load_params(self, *args, **kwargs):
    """Parameters placed with the rollout sharding (given, from ``hf_path``, or random)."""
    del args, kwargs
    if self._params is not None:
      return self.place_params(self._params)
    if self._hf_path:
      config, params = models.load_hf(self._hf_path, dtype=self.config.dtype,
                                      param_dtype=self.config.param_dtype)
      if config.replace(max_seq_len=self.config.max_seq_len) != self.config:
        raise ValueError(f"{self._hf_path}: checkpoint config {config} does not match the engine's "
                         f"{self.config}")
      return self.place_params(params)
    return self.place_params(models.init_params(self.config, jax.random.key(self._seed), mesh=self._mesh))

  def param_spec(self):
    """The parameters' shapes, serving dtypes (``models.serving_dtypes``) and rollout shardings
    (``jax.ShapeDtypeStruct`` leaves): what a weight pull needs to know, without any weights."""
    return jax.tree.map(lambda a, dt, s: jax.ShapeDtypeStruct(a.shape, dt, sharding=s),
                        models.abstract_params(self.config), models.serving_dtypes(self.config),
                        self.param_shardings)

  def served_spec(self):
    """``param_spec`` as the programs take it: with ``weight_dtype="int8"``, the quantized tree
    (int8 kernels and their scales, ``models.quant``)."""
    spec = self.param_spec()
    if self._jit_quantize is None:
      return spec
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        jax.eval_shape(quant.quantize, spec), self.served_shardings)

  def place_params(self, params):
    """A parameter pytree (any mesh, or the host) on the rollout sharding, in the serving dtypes
    (cast where it lies: a float32 copy never lands here); with ``weight_dtype="int8"``, quantized
    (``models.quant``; weights already quantized are only placed)."""
    if quant.is_quantized(params):
      return jax.device_put(params, self.served_shardings)
    placed = jax.device_put(models.serving_params(self.config, params), self.param_shardings)
    return self._jit_quantize(placed) if self._jit_quantize is not None else placed

  def get_prefix_destination_sharding(self) -> Any:
    return self._replicated

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path=self.tokenizer_path or "builtin")

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JetStreamTokenizer:
    del metadata  # the engine already holds its tokenizer
    return JetStreamTokenizer(self.tokenizer, self._max_prefill)

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    del args, kwargs
    if self._make_state is None:
      self._make_state = self._build_make_state()
    return self._make_state()

  def _state_shardings(self) -> DecodeState:
    """Where the decode state lives: slots split over ``data`` x ``fsdp``, the KV cache's heads over
    ``tensor`` (as the key and value projections are), the RNG key replicated."""
    cache_sharding = NamedSharding(self._mesh, PartitionSpec(sharding_lib.BATCH_AXES, None, "tensor", None))
    return DecodeState(cache=cache_sharding, logits=sharding_lib.batch_sharding(self._mesh, 2),
                       positions=self._slot_sharding, generated=self._slot_sharding,
                       budget=self._slot_sharding, rng=self._replicated,
                       streams=sharding_lib.batch_sharding(self._mesh, 2), min_left=self._slot_sharding,
                       routes=sharding_lib.batch_sharding(self._mesh, 4) if self.record_routes else None)

  def _build_make_state(self):
    c, s, length = self.config, self.num_slots, self.max_target_length

    @functools.partial(jax.jit, out_shardings=self._state_shardings())
    def make():
      return DecodeState(cache=models.init_cache(c, s, length, layout=self.cache_layout),
                         logits=jnp.zeros((s, c.vocab_size), jnp.float32),
                         positions=jnp.zeros((s,), jnp.int32), generated=jnp.zeros((s,), jnp.int32),
                         budget=jnp.zeros((s,), jnp.int32), rng=jax.random.key(self._seed),
                         streams=jnp.zeros((s, 2), jnp.int32), min_left=jnp.zeros((s,), jnp.int32),
                         routes=jnp.zeros((s, length, *c.route_shape),
                                          models.moe.ROUTE_DTYPE) if self.record_routes else None)
    return make

  def slot_routes(self, decode_state: DecodeState, slot: int) -> jax.Array:
    """The routes recorded in ``slot``'s cache positions, ``[L, L_moe, k]`` int16 on the device (a
    copy: the state may be donated after). Needs ``record_routes``."""
    if not self.record_routes:
      raise ValueError("this engine does not record routes (record_routes=False)")
    if self._jit_slot_routes is None:
      self._jit_slot_routes = jax.jit(lambda routes, slot: jnp.take(routes, slot, axis=0),
                                      out_shardings=self._replicated)
    return self._jit_slot_routes(decode_state.routes, jax.device_put(np.int32(slot), self._replicated))

  def _forward(self, params, tokens, positions, cache, **kwargs):
    """``models.apply_decode``, with the routes when they are recorded (else None)."""
    out = models.apply_decode(self.config, params, tokens, positions, cache, self._mesh,
                              with_routes=self.record_routes, **kwargs)
    return out if self.record_routes else (*out, None)

  def prefill(self, *, params, existing_prefix: Optional[Prefix] = None, padded_tokens,
              true_length: int) -> Prefix:
    """KV cache and next-token logits of one prompt (``padded_tokens`` [P], right-padded)."""
    padded_tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
    if not 1 <= true_length <= min(len(padded_tokens), self._max_prefill):
      raise ValueError(f"true_length={true_length} must be in [1, min(len(padded_tokens)="
                       f"{len(padded_tokens)}, max_prefill_length={self._max_prefill})]")
    if existing_prefix is not None:  # the new tokens continue the prefix (its cache is reused)
      room = models.cache_length(existing_prefix.cache) + len(padded_tokens)
      if room > self.max_target_length:
        raise ValueError(f"the prefix's cache ({models.cache_length(existing_prefix.cache)}) plus "
                         f"{len(padded_tokens)} tokens exceeds max_target_length={self.max_target_length}")
      return self._jit_prefill_more(params, existing_prefix, jnp.asarray(padded_tokens[None]),
                                    int(true_length))
    return self._jit_prefill(params, jnp.asarray(padded_tokens[None]), int(true_length))

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    if not 0 <= slot < self.num_slots:
      raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
    stream = jnp.asarray(self.default_stream(), jnp.int32)
    return self._jit_insert(prefix, decode_state, jnp.int32(slot), stream)

  def default_stream(self) -> tuple[int, int]:
    """The sampling stream of a request inserted without one (this engine's next)."""
    return sampling_stream(f"{self._stream_salt}#{next(self._default_streams)}")

  def generate(self, params, decode_state: DecodeState):
    decode_state, tokens, _ = self._jit_step(params, decode_state)
    s = self.num_slots
    data = jnp.stack([tokens, jnp.ones((s,), jnp.int32), decode_state.generated], axis=1)
    return decode_state, engine_api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2),
                                                 length_idx=(2, 3), samples_per_slot=1)

  # ------------------------------------------------------------------ RL extensions

  def step(self, params, decode_state: DecodeState):
    """One decode step for every slot: (new state, sampled tokens [S], their log-probs [S])."""
    return self._jit_step(params, decode_state)

  def steps(self, params, decode_state: DecodeState, max_steps: int):
    """Up to ``max_steps`` fused decode steps, stopping early after the step in which any busy slot
    finishes (emits a stop token or exhausts its ``budget``), so freed slots can be refilled at once.

    Returns (new state, tokens [S, max_steps], log-probs [S, max_steps], steps taken n): columns
    ``>= n`` are unused. Fewer dispatches and host round trips per token when nothing finishes.
    """
    return self._decode_chunk(max_steps)(params, decode_state)

  def _decode_chunk(self, max_steps: int):
    if max_steps not in self._jit_steps:
      def chunk(params, state):
        return self._steps_impl(params, state, max_steps)
      state = self._state_shardings()
      self._jit_steps[max_steps] = jax.jit(
          bounded_traces(chunk, "decode_chunk", 1), donate_argnums=(1,),
          in_shardings=(self.served_shardings, state),
          out_shardings=(state, self._slot_sharding, self._slot_sharding, self._replicated))
    return self._jit_steps[max_steps]

  def abstract_decode_state(self) -> DecodeState:
    """The decode state's shapes and dtypes on its shardings (``jax.ShapeDtypeStruct`` leaves)."""
    if self._make_state is None:
      self._make_state = self._build_make_state()
    shapes = jax.eval_shape(self._make_state)
    return jax.tree.map(lambda sharding, sub: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), sub),
                        self._state_shardings(), shapes)

  def programs(self, steps_per_call: int, shapes: str = "covering") -> list:
    """``(name, jitted function, arguments)`` of the programs a decode server runs, from shapes
    (``param_spec``, ``abstract_decode_state``), for compiling without running: the fused decode
    chunk of ``steps_per_call`` steps, then the batched prefill of new prompts and the re-prefill
    after a weight update at their shapes (``ShapedPrefill.programs``: ``"all"`` or ``"covering"``)."""
    params, state = self.served_spec(), self.abstract_decode_state()
    return ([(f"decode_chunk[{steps_per_call} steps]", self._decode_chunk(steps_per_call),
              (params, state))]
            + self._prefill_insert_calls.programs(params, state, 6, shapes)
            + self._refill_calls.programs(params, state, 2, shapes))

  def prefill_insert(self, params, decode_state: DecodeState, prompts: Sequence[Sequence[int]],
                     slots: Sequence[int], max_new_tokens: Optional[Sequence[int]] = None,
                     min_new_tokens: Optional[Sequence[int]] = None,
                     streams: Optional[Sequence[tuple[int, int]]] = None) -> DecodeState:
    """Prefills several prompts in one batched pass and inserts them into ``slots``.

    Each slot may then generate ``max_new_tokens[i]`` tokens (default: until the cache is full), and
    samples no stop token before it has ``min_new_tokens[i]`` (default 0; see ``models.sampling``).
    ``streams[i]``: the request's sampling stream (``sampling_stream(request_id)``; default: the
    engine's next ``default_stream``).

    Prompts are grouped by length into a few calls of ``(rows, width)`` shapes (``prefill_plan``;
    padding rows target slot ``S`` and are dropped), so only a few shapes are ever compiled.
    """
    if len(prompts) != len(slots) or not prompts:
      raise ValueError("prefill_insert needs one slot per prompt and at least one prompt")
    longest = max(len(p) for p in prompts)
    if longest > self._max_prefill:
      raise ValueError(f"a prompt has {longest} tokens, more than max_prefill_length={self._max_prefill}")
    tokens = np.zeros((len(prompts), longest), np.int32)
    lengths = np.zeros(len(prompts), np.int32)
    slot_ids = np.zeros(len(prompts), np.int32)
    budgets = np.zeros(len(prompts), np.int32)
    minimums = np.zeros(len(prompts), np.int32)
    if streams is None:
      streams = [self.default_stream() for _ in prompts]
    streams = np.asarray(streams, np.int64).reshape(-1, 2) if len(streams) else np.zeros((0, 2), np.int64)
    if len(streams) != len(prompts) or streams.min(initial=0) < 0 or streams.max(initial=0) >= 2**31:
      raise ValueError(f"prefill_insert needs one stream (two ints in [0, 2**31)) per prompt, got "
                       f"{streams.shape[0]} for {len(prompts)} prompts")
    streams = streams.astype(np.int32)
    for i, (p, slot) in enumerate(zip(prompts, slots)):
      if not 0 <= slot < self.num_slots:
        raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
      if not len(p):
        raise ValueError(f"prompt {i} is empty")
      room = self.max_target_length - len(p)
      budget = room if max_new_tokens is None else int(max_new_tokens[i])
      if not 1 <= budget <= room:
        raise ValueError(f"prompt {i}: max_new_tokens={budget} must be in [1, {room}] (cache room)")
      minimum = 0 if min_new_tokens is None else int(min_new_tokens[i])
      if not 0 <= minimum <= budget:
        raise ValueError(f"prompt {i}: min_new_tokens={minimum} must be in [0, max_new_tokens={budget}]")
      minimums[i] = minimum
      tokens[i, :len(p)] = p
      lengths[i] = len(p)
      slot_ids[i] = slot
      budgets[i] = budget
    # padding rows: length 1, slot S (dropped by the scatter), budget 0, minimum 0
    return self._prefill_insert_calls(params, decode_state, lengths, tokens,
                                      [(lengths, 1), (slot_ids, self.num_slots), (budgets, 0),
                                       (minimums, 0), (streams[:, 0], 0), (streams[:, 1], 0)],
                                      self.prefill_call_overhead)

  def refill(self, params, decode_state: DecodeState, tokens_sp, lengths_s) -> DecodeState:
    """Recomputes every slot's KV cache and next-token logits from ``tokens_sp[:, :lengths]``.

    Used when weights change: in-flight sequences continue under the new ``params`` exactly as if their
    prompt and tokens so far had been prefilled with them. Rows with length 0 are left idle. Slots are
    prefilled in a few calls of similar lengths (``prefill_plan``), not all at the longest one's width.
    """
    tokens_sp = np.asarray(tokens_sp, np.int32)
    lengths_s = np.asarray(lengths_s, np.int32)
    if tokens_sp.ndim != 2 or tokens_sp.shape[0] != self.num_slots or lengths_s.shape != (self.num_slots,):
      raise ValueError(f"refill needs [{self.num_slots}, P] tokens and [{self.num_slots}] lengths, got "
                       f"{tokens_sp.shape} and {lengths_s.shape}")
    if lengths_s.max(initial=0) >= self.max_target_length:
      raise ValueError(f"a slot holds {lengths_s.max()} tokens; the cache has {self.max_target_length}")
    if lengths_s.max(initial=0) > tokens_sp.shape[1] or lengths_s.min(initial=0) < 0:
      raise ValueError(f"lengths must be in [0, {tokens_sp.shape[1]}] (the tokens given per slot)")
    slot_ids = np.arange(self.num_slots, dtype=np.int32)
    return self._refill_calls(params, decode_state, lengths_s, tokens_sp,
                              [(lengths_s, 1), (slot_ids, self.num_slots)], self.prefill_call_overhead)

  def compiled_shapes(self) -> dict:
    """The (rows, width) shapes compiled so far, per batched prefill ("prefill_insert", "refill")."""
    return {c.name: c.compiled for c in (self._prefill_insert_calls, self._refill_calls)}

  def warm_up(self, decode_state: Optional[DecodeState] = None) -> None:
    """Starts compiling, in the background, every shape of the new-prompt prefill and of the re-prefill
    (``prefill_shapes``; the covering ones first), so that calls rarely wait for a compilation or run
    at a larger shape than they want (a no-op without ``background_compile``). Needs no weights:
    shapes and shardings come from ``param_spec`` (and the decode state's from ``decode_state``, or
    ``init_decode_state``'s abstract evaluation)."""
    if decode_state is None:
      if self._make_state is None:
        self._make_state = self._build_make_state()
      decode_state = jax.eval_shape(self._make_state)
    if self._refill_calls.background:
      self._prefill_insert_calls.warm_up(self.param_spec(), decode_state, 6)
      self._refill_calls.warm_up(self.param_spec(), decode_state, 2)

  def compiles_pending(self) -> bool:
    """Whether a background compilation is running."""
    return self._prefill_insert_calls.pending() or self._refill_calls.pending()

  def wait_for_compiles(self, timeout: float = 600.0) -> bool:
    """Waits until no background compilation is running; False if ``timeout`` seconds passed first."""
    deadline = time.time() + timeout
    while self.compiles_pending():
      if time.time() > deadline:
        return False
      time.sleep(0.05)
    return True

  # ------------------------------------------------------------------ jitted bodies

  def _prefill_impl(self, params, tokens_1p, true_length: int) -> Prefix:
    p = tokens_1p.shape[1]
    cache = models.init_cache(self.config, 1, p, layout=self.cache_layout)
    positions = jnp.arange(p, dtype=jnp.int32)[None]
    logits, cache = models.apply_decode(self.config, params, tokens_1p, positions, cache,
                                        logits_at_b=jnp.full((1,), true_length - 1, jnp.int32))
    return Prefix(cache=cache, logits=logits[:, 0], length=jnp.int32(true_length))

  def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, stream) -> DecodeState:
    def put(big, small):
      small = small.astype(big.dtype)
      return jax.lax.dynamic_update_slice(big, small, (slot,) + (0,) * (big.ndim - 1))
    cache = jax.tree.map(put, state.cache, prefix.cache)
    return state.replace(
        cache=cache, logits=put(state.logits, prefix.logits),
        positions=state.positions.at[slot].set(prefix.length),
        generated=state.generated.at[slot].set(0), streams=state.streams.at[slot].set(stream),
        budget=state.budget.at[slot].set(self.max_target_length - prefix.length),
        min_left=state.min_left.at[slot].set(0))

  def _step_impl(self, params, state: DecodeState):
    banned = (state.min_left > 0) & (state.budget > 0)
    keys = token_keys(state.rng, state.streams, state.positions)
    tokens, logp = sample(ban_stop_tokens(state.logits, banned, self._stop_ids), keys, self.sampling)
    positions = jnp.minimum(state.positions, self.max_target_length - 1)
    logits, cache, routes = self._forward(params, tokens[:, None], positions[:, None], state.cache,
                                          decode=self.decode_attention)
    if routes is not None:
      routes = state.routes.at[jnp.arange(self.num_slots), positions].set(routes[:, 0])
    active = state.budget > 0
    finishing = active & (jnp.isin(tokens, self._stop_ids) | (state.budget == 1))
    budget = jnp.where(finishing, 0, jnp.maximum(state.budget - 1, 0))
    new_state = DecodeState(cache=cache, logits=logits[:, 0], positions=state.positions + 1,
                            generated=state.generated + 1, budget=budget, rng=state.rng,
                            streams=state.streams, min_left=jnp.maximum(state.min_left - 1, 0),
                            routes=routes)
    return new_state, tokens, logp

  def _steps_impl(self, params, state: DecodeState, max_steps: int):
    s = self.num_slots

    def cond(carry):
      i, state, _, _, _ = carry
      any_finished = jnp.any((carry[4] > 0) & (state.budget == 0))
      return (i < max_steps) & ~any_finished & jnp.any(state.budget > 0)

    def body(carry):
      i, state, tokens, logps, was_active = carry
      state, tok, lp = self._step_impl(params, state)
      return i + 1, state, tokens.at[:, i].set(tok), logps.at[:, i].set(lp), was_active

    init = (jnp.int32(0), state, jnp.zeros((s, max_steps), jnp.int32),
            jnp.zeros((s, max_steps), jnp.float32), state.budget)
    n, state, tokens, logps, _ = jax.lax.while_loop(cond, body, init)
    return state, tokens, logps, n

  def _prefill_scatter(self, params, state: DecodeState, tokens_np, lengths_n, slots_n) -> DecodeState:
    """Prefills ``tokens_np`` [N, P] from position 0 and writes each row's cache, next-token logits and
    position into slot ``slots_n[i]``; out-of-range slot ids (padding rows) are dropped.

    Keys and values go straight into the slots' rows of the (donated) decode cache: no second cache of
    the N rows is built, and padding rows write nothing.
    """
    n, p = tokens_np.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
    # next-token logits at each row's last prompt token only: [N, 1, V], not [N, P, V]
    # Cache entries beyond a row's length may hold padding's keys; they are never read (see transformer).
    logits, cache, routes = self._forward(params, tokens_np, positions, state.cache,
                                          logits_at_b=jnp.maximum(lengths_n - 1, 0), cache_rows_b=slots_n,
                                          attention_chunk=self.attention_chunk)
    if routes is not None:  # (a padding row's slot id is out of range: dropped)
      state = state.replace(routes=state.routes.at[slots_n[:, None], positions].set(routes, mode="drop"))
    return state.replace(cache=cache,
                         logits=state.logits.at[slots_n].set(logits[:, 0], mode="drop"),
                         positions=state.positions.at[slots_n].set(lengths_n, mode="drop"))

  def _prefill_insert_impl(self, params, state: DecodeState, tokens_np, lengths_n, slots_n, budgets_n,
                          minimums_n, streams_hi_n, streams_lo_n):
    state = self._prefill_scatter(params, state, tokens_np, lengths_n, slots_n)
    streams = jnp.stack([streams_hi_n, streams_lo_n], axis=1)
    return state.replace(generated=state.generated.at[slots_n].set(0, mode="drop"),
                         streams=state.streams.at[slots_n].set(streams, mode="drop"),
                         budget=state.budget.at[slots_n].set(budgets_n, mode="drop"),
                         min_left=state.min_left.at[slots_n].set(minimums_n, mode="drop"))

  def _refill_impl(self, params, state: DecodeState, tokens_np, lengths_n, slots_n) -> DecodeState:
    # Same as a prefill into the slot, but the slot keeps its count of generated tokens, its budget
    # and its minimum length still to go.
    return self._prefill_scatter(params, state, tokens_np, lengths_n, slots_n)


def sampling_stream(request_id: str) -> tuple[int, int]:
  """A request's sampling stream: two numbers in [0, 2**31) from its id, the same in every process
  (a 62-bit digest: two requests of a run share a stream with negligible probability, and the
  members of a group, whose ids differ, draw independently)."""
  digest = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
  return digest & 0x7FFFFFFF, (digest >> 31) & 0x7FFFFFFF


def token_keys(base: jax.Array, streams: jax.Array, positions: jax.Array) -> jax.Array:
  """The sampling key of each slot's next token ([S] keys): the run's key folded with the slot's
  request stream and the token's position in the sequence."""
  def one(stream, position):
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, stream[0]), stream[1]), position)
  return jax.vmap(one)(streams, positions)


def engine_from_config(config, mesh: Mesh, model_config: ModelConfig, *, params=None,
                       seed: Optional[int] = None, stream_salt: str = "") -> "Engine":
  """The engine an experiment config describes, on the rollout ``mesh`` (built by the caller, who owns
  it) for ``model_config`` (``models.config_of(config)``); ``seed``: its sampling seed (default
  ``config.seed``, the same on every decode server of a run: sampling keys come from each request's id,
  see ``sampling_stream``)."""
  return Engine(model_config, mesh=mesh, num_slots=config.rollout.num_slots,
                max_prefill_length=config.data.max_prompt_len,
                max_target_length=config.data.max_prompt_len + config.data.max_completion_len,
                sampling=SamplingSettings.from_config(config), tokenizer=tokenizer_of(config),
                tokenizer_path=config.data.tokenizer_path, params=params,
                hf_path=config.model.hf_path, seed=config.seed if seed is None else seed,
                attention_chunk=config.rollout.attention_chunk,
                prefill_tokens=config.rollout.prefill_tokens,
                decode_attention=config.rollout.decode_attention, stream_salt=stream_salt,
                weight_dtype=config.rollout.get("weight_dtype", ""),
                record_routes=bool(config.rollout.get("record_routes", False)))

