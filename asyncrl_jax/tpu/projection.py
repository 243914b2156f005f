"""What the compiled programs imply for a run: learner tokens/s and MFU, decode tokens/s per server
against the live-cache roofline, and the best rollout:learner split and eta by the planner.

Everything here is arithmetic on the TPU compiler's roofline times (``tpu.compile``), the config and
a length distribution (the seed's by default: ``SEED_LENGTHS``): projections, not measurements.

* **Model FLOPs** per trained token (``model_flops_per_token``): 6 x matrix parameters plus causal
  attention within each sequence at the token-weighted mean sequence length (``attention_length``);
  MFU = model FLOPs x tokens/s / (chips x peak bf16).
* **Decode's live roofline** (``decode_live_step``): the bytes a decode step must read, the serving
  weights once plus the KV cache of the positions each slot has filled (``live_context``: a slot's
  time-averaged context, prompt + sum(L^2) / (2 sum(L))), over HBM bandwidth; the compiled step's
  ratio to it says how much of the cache read is waste.
* **The split** (``plan_split``): every legal learner slice size of the generation (``chips.SLICES``)
  with the rest of the chips as whole decode-server hosts, every eta, through the straggler
  simulator (``sim.planner``); the learner is charged prompt and completion tokens. The synchronous
  baseline is colocated (both roles on every chip, taking turns) when the two fit one chip together
  by the memory estimate (``tpu.memory``), else synchronous RL on separate slices (eta 0 at its best
  split).
"""

from __future__ import annotations

import math

import numpy as np

# The seed's completion lengths (lognormal, median e^7.4 ~ 1636 tokens, sigma 1.15), capped at the
# config's completion length; prompts at half their cap.
SEED_LENGTHS = dict(mu=7.4, sigma=1.15)


def model_flops_per_token(m, attention_length: float) -> float:
  """Training FLOPs per token (forward and backward) by the usual count: 6 x the matrix parameters
  (the embedding lookup is not a product; a tied embedding counts once, as the output layer) plus
  causal attention, 6 x layers x heads x head_dim x ``attention_length`` (a token at position i
  attends i + 1 keys: 2 products of 2 x i x head_dim FLOPs per head forward, 3x that with the
  backward pass, i averaging half its sequence's length).

  ``attention_length`` is the token-weighted mean length of the *sequences* (``attention_length``
  below), not the packed row's width: packed sequences never attend to one another.

  With LoRA the frozen base has no weight gradients: its matrices count 4 x (forward, and the
  backward pass's gradient with respect to their inputs), the adapters 6 x. A mixture of experts
  counts the parameters a token passes through (``num_active_params``: the router and its k
  experts, not all E)."""
  embed = m.vocab_size * m.hidden_size
  # every parameter but the embedding table's lookup; a tied table is the output layer's matrix
  matrix = m.num_active_params - (0 if m.tie_embeddings else embed)
  weights = (4.0 * matrix + 6.0 * m.num_lora_params) if m.lora else 6.0 * matrix
  return weights + 6.0 * m.num_layers * m.num_heads * m.head_dim * attention_length


def attention_length(lengths) -> float:
  """The token-weighted mean sequence length, sum(L^2) / sum(L): the length whose causal attention
  costs, per token, what the sequences ``lengths`` cost on average."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  lengths = np.asarray(lengths, np.float64)
  return float((lengths ** 2).sum() / lengths.sum())


def splash_visited_fraction(config, row_len: int, *, n: int = 4096) -> float:
  """The share of the causal splash kernel's block pairs that rows of packed sequences visit: ``n``
  sequences of the seed's lengths packed into rows of ``row_len`` as the learner packs them
  (``rl.batching.pack``), each row skipping the pairs that share no segment
  (``models.attention.segment_block_overlap``: computed with the same rule in numpy here)."""
  from asyncrl_jax.models.attention import splash_block  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl import batching  # pylint: disable=import-outside-toplevel
  _, sequences = seed_sequences(config, n)
  lengths = np.minimum(sequences.astype(np.int64), row_len)
  block = splash_block(row_len)
  blocks = -(-row_len // block)
  causal = np.tril(np.ones((blocks, blocks), bool))
  visited = total = 0
  for row in batching.pack(lengths.tolist(), row_len):
    seg = np.full(blocks * block, len(row) + 1)  # padding: one more segment after the last
    start = 0
    for k, i in enumerate(row):
      seg[start:start + lengths[i]] = k + 1
      start += lengths[i]
    ids = seg.reshape(blocks, block)
    lo, hi = ids.min(axis=1), ids.max(axis=1)
    overlap = (lo[:, None] <= hi[None, :]) & (lo[None, :] <= hi[:, None])
    visited += int((overlap & causal).sum())
    total += int(causal.sum())
  return visited / total


# Which of a program's kernel figures (``tpu.compile``'s ``kernels``) scale with a share of the work
# the compiled program was costed at: splash's block pairs (a row's skipped pairs depend on its
# segment ids), a paged decode's cache (a slot's pages up to its position).
SCALED = {"splash_blocks": ("flops", "reread_bytes"), "live_cache": ("paged_flops", "paged_bytes")}


def roofline_at(program: dict, chip, share: float, work: str) -> float:
  """A program's roofline seconds with its kernels' ``work`` (``SCALED``) at ``share`` of what it
  was costed at."""
  flops_key, bytes_key = SCALED[work]
  kernels = program.get("kernels") or {}
  flops = program["flops"] - kernels.get(flops_key, 0.0) * (1 - share)
  traffic = program["bytes_accessed"] - kernels.get(bytes_key, 0.0) * (1 - share)
  return max(flops / chip.bf16_flops, traffic / chip.hbm_bandwidth)


def seed_sequences(config, n: int = 100_000):
  """``(LengthModel of completions, sequences)``: completion lengths of the seed's distribution capped
  at the config's, and ``n`` drawn sequences (prompt at half its cap + completion)."""
  from asyncrl_jax.sim.lengths import LengthModel  # pylint: disable=import-outside-toplevel
  lengths = LengthModel(mu=SEED_LENGTHS["mu"], sigma=SEED_LENGTHS["sigma"],
                        cap=int(config.data.max_completion_len))
  return lengths, lengths.draw(np.random.default_rng(0), n) + int(config.data.max_prompt_len) / 2


def live_context(sequences, prompt: float) -> float:
  """A decode slot's time-averaged context: it holds a sequence of L completion tokens for L steps at
  contexts prompt .. prompt + L, so prompt + sum(L^2) / (2 sum(L))."""
  completions = np.asarray(sequences, np.float64) - prompt
  return float(prompt + (completions ** 2).sum() / (2 * completions.sum()))


def decode_live_step(config, m, chip, *, server_chips: int, context: float) -> dict:
  """The decode step's live roofline per chip: serving weights (bfloat16 where the model computes
  in it) once, plus each of its slots' KV cache up to ``context`` positions, over HBM bandwidth."""
  from asyncrl_jax.tpu import memory  # pylint: disable=import-outside-toplevel
  mesh = memory.mesh_sizes(config.mesh.rollout, server_chips)
  slots = int(config.rollout.num_slots) / mesh.rows
  kv_per_token = 2 * m.num_layers * m.num_kv_heads / mesh.tensor * m.head_dim * np.dtype(m.dtype).itemsize
  weights = memory.serving_bytes(m) * memory.param_shard(m, mesh)
  kv = slots * context * kv_per_token
  return {"weights_bytes": weights, "live_kv_bytes": kv,
          "seconds": (weights + kv) / chip.hbm_bandwidth}


def learner_rates(config, m, learner: dict) -> dict:
  """The learner role's rates implied by its programs' roofline times (``learner``: a role of
  ``compile_config``'s report): tokens/s over its chips, MFU (``model_flops_per_token`` at the
  seed's lengths), seconds per micro-batch, micro-batches per update."""
  from asyncrl_jax.tpu.chips import CHIPS  # pylint: disable=import-outside-toplevel
  chip = CHIPS[learner["chip"]]
  fraction = (splash_visited_fraction(config, int(learner["row_len"]))
              if config.learner.attention == "splash" else 1.0)
  times = {p["name"]: roofline_at(p, chip, fraction, "splash_blocks") for p in learner["programs"]}
  # the tokens per micro-batch the programs were compiled for: a record of another slice size keeps
  # its own (records before this field: one row per chip, as every shipped config had)
  budget = int(learner.get("token_budget") or learner["chips"] * learner["row_len"])
  minibatches = int(config.learner.ppo_minibatches)
  _, sequences = seed_sequences(config)
  mean_len = float(sequences.mean())
  per_update = int(config.learner.batch_size) / minibatches * mean_len
  mbs = max(1.0, math.ceil(per_update / budget))
  per_mb = times["grad_step[first]"] + times.get("accumulate", 0.0) + times["apply"] / mbs
  if "prox_pass" in times:  # every minibatch after a version's first needs its prox log-probs
    per_mb += times["prox_pass"] * (minibatches - 1) / minibatches
  if "value_estimate" in times:
    per_mb += sum(t for k, t in times.items() if k.startswith("value_"))
  tokens_per_s = budget / per_mb
  seq_attention = attention_length(sequences)
  flops_per_token = model_flops_per_token(m, seq_attention)
  return {"learner_tokens_per_s": tokens_per_s,
          "learner_mfu": flops_per_token * tokens_per_s / (learner["chips"] * chip.bf16_flops),
          "splash_visited_fraction": fraction,
          "learner_program_seconds": times,
          "attention_length": seq_attention, "model_flops_per_token": flops_per_token,
          "learner_seconds_per_micro_batch": per_mb, "micro_batches_per_update": mbs,
          "mean_trajectory_tokens": mean_len}


def plan_split(config, m, *, kind: str, total_chips: int, server_chips: int, learner_chips: int,
               decode_tok_s_per_chip: float, train_tok_s_per_chip: float, slots_per_chip: int,
               margin: float = 0.2, etas=(0, 1, 2, 4, 8), epochs: int = 20) -> dict:
  """The planner over the legal splits of ``total_chips`` chips of ``kind``: learner slices of
  ``chips.SLICES[kind]`` chips, decode servers of ``server_chips`` on the rest, each eta; and the
  synchronous baseline (see the module docstring). Rates are per chip; the learner's in trained
  tokens of both prompt and completion."""
  from asyncrl_jax.sim import planner  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.tpu import chips as chips_lib, memory  # pylint: disable=import-outside-toplevel
  lengths, sequences = seed_sequences(config)
  prompt = int(config.data.max_prompt_len) / 2
  completion = float(sequences.mean()) - prompt
  # the simulator counts completion tokens: the learner's rate in those, charged for the prompts too
  train_completion = train_tok_s_per_chip * completion / (completion + prompt)
  rates = planner.Throughputs(decode_tok_s=decode_tok_s_per_chip, train_tok_s=train_completion,
                              slots_per_device=max(1, slots_per_chip))
  batch = int(config.learner.batch_size)
  per_chip_budget = int(config.learner.token_budget) / learner_chips
  usable = (1 - margin) * chips_lib.CHIPS[kind].hbm_bytes
  etas = sorted(set(etas) | {int(config.rl.max_staleness)})


  def learner_bytes(n: int) -> float:  # per chip, the micro-batch scaled with the slice
    scaled = config.copy_and_resolve_references()
    scaled.learner.token_budget = max(int(per_chip_budget * n), 1)
    try:
      memory.mesh_sizes(scaled.mesh.learner, n)
    except ValueError:  # the config's replicas do not divide this slice: FSDP over all of it
      scaled.mesh.learner.update(data=1, fsdp=-1, tensor=1)
    return memory.learner(scaled, m, n).total

  candidates = []
  for n_learner in chips_lib.SLICES[kind]:
    n_rollout = (total_chips - n_learner) // server_chips * server_chips
    if n_rollout < server_chips:
      continue
    fits = learner_bytes(n_learner) <= usable
    for eta in etas:
      c = planner.predict(lengths, rates, rollout_devices=n_rollout, learner_devices=n_learner,
                          eta=eta, batch=batch, epochs=epochs)
      candidates.append({"learner_chips": n_learner, "rollout_chips": n_rollout, "eta": eta,
                         "fits": fits, "tokens_per_s": c.tokens_per_s,
                         "learner_idle": c.learner_idle_fraction, "slot_utilization": c.slot_utilization})
  # the synchronous baseline: colocated when both roles fit one chip together, else separate slices
  together = learner_bytes(total_chips) + memory.decode_server(config, m, server_chips).total
  colocated_fits = together <= usable
  if colocated_fits:
    s = planner.predict_colocated_sync(lengths, rates, devices=total_chips, batch=batch, epochs=epochs)
    sync = {"kind": "colocated", "tokens_per_s": s.tokens_per_s}
  else:
    at_zero = [c for c in candidates if c["eta"] == 0]
    fitting = [c for c in at_zero if c["fits"]]
    best0 = max(fitting or at_zero, key=lambda c: c["tokens_per_s"])
    sync = {"kind": "separate slices (eta 0)" + ("" if fitting else ", none fits by the estimate"),
            "tokens_per_s": best0["tokens_per_s"],
            "learner_chips": best0["learner_chips"], "rollout_chips": best0["rollout_chips"]}
  sync["colocated_bytes_per_chip"] = together
  for c in candidates:
    c["over_sync"] = c["tokens_per_s"] / sync["tokens_per_s"]
  legal = [c for c in candidates if c["fits"]]
  best = max(legal, key=lambda c: c["tokens_per_s"]) if legal else None
  own = next((c for c in candidates if c["learner_chips"] == learner_chips
              and c["eta"] == int(config.rl.max_staleness)), None)
  return {"best": best, "config_split": own, "sync": sync, "candidates": candidates,
          "lengths": lengths.describe()}


def project(config, m, roles: dict, *, steps_per_call: int = 16, epochs: int = 20) -> dict:
  """Rates implied by the roofline times: learner tokens/s and MFU, decode tokens/s per server and
  its ratio to the live-cache roofline, and the planner's split search (``plan_split``) with the
  config's own split beside the best."""
  from asyncrl_jax.tpu.chips import CHIPS  # pylint: disable=import-outside-toplevel
  learner, rollout = roles["learner"], roles["rollout"]
  rates_l = learner_rates(config, m, learner)
  chips_l, server = learner["chips"], rollout["chips"]
  chunk = next(p for p in rollout["programs"] if p["name"].startswith("decode_chunk"))
  slots = int(config.rollout.num_slots)
  prompt = int(config.data.max_prompt_len) / 2
  _, sequences = seed_sequences(config)
  context = live_context(sequences, prompt)
  cache_len = int(config.data.max_prompt_len) + int(config.data.max_completion_len)
  # a paged kernel reads each slot's cache only up to its position: its share at the live context
  step = roofline_at(chunk, CHIPS[rollout["chip"]], context / cache_len, "live_cache") / steps_per_call
  live = decode_live_step(config, m, CHIPS[rollout["chip"]], server_chips=server, context=context)
  fraction = float(learner.get("rollout_fraction", config.mesh.rollout_fraction))
  rollout_chips = max(1, int(round(chips_l * fraction / (1 - fraction)))) // server * server
  rollout_chips = max(rollout_chips, server)
  plan = plan_split(config, m, kind=learner["chip"], total_chips=chips_l + rollout_chips,
                    server_chips=server, learner_chips=chips_l,
                    decode_tok_s_per_chip=slots / step / server,
                    train_tok_s_per_chip=rates_l["learner_tokens_per_s"] / chips_l,
                    slots_per_chip=slots // server, margin=float(learner["margin"]), epochs=epochs)
  own = plan["config_split"]
  return {
      **rates_l,
      "decode_tokens_per_s": slots / step, "decode_step_seconds": step,
      "decode_context_length": int(config.data.max_prompt_len) + int(config.data.max_completion_len),
      "decode_live_context": context, "decode_live_step_seconds": live["seconds"],
      "decode_step_over_live_roofline": step / live["seconds"],
      "decode_live_bytes": {"weights": live["weights_bytes"], "kv": live["live_kv_bytes"]},
      "decode_servers": rollout_chips // server, "rollout_chips": rollout_chips,
      "learner_chips": chips_l, "lengths": plan["lengths"],
      "async_over_sync": own["over_sync"] if own else None,
      "sync_baseline": plan["sync"]["kind"],
      "planner_best": plan["best"], "planner_sync": plan["sync"], "planner_candidates": plan["candidates"],
      "notes": ("roofline times (max of FLOPs / peak bf16 and bytes / HBM bandwidth per chip) of the "
                "TPU compiler's programs, not measurements; trajectories of the seed's lengths with "
                "prompts at half their cap; MFU counts model_flops_per_token (6 x matrix parameters + "
                "causal attention within each sequence, at the token-weighted mean sequence length); "
                "the learner is charged prompt and completion tokens; the planner assumes per-chip "
                "rates independent of the slice size"),
  }
