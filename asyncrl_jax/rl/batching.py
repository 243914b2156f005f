"""Dynamic micro-batching: first-fit-decreasing packing under a token budget, and the packed arrays.

Reasoning traces are heavy-tailed, so fixed-size micro-batches padded to their longest member waste most
of their FLOPs on padding. Instead, sequences are packed:

1. ``pack(lengths, capacity)``: first-fit decreasing: longest first, each into the first bin with room.
2. ``plan_micro_batches(lengths, token_budget, row_len)``: sequences are packed into rows of ``row_len``
   tokens, and rows are grouped ``token_budget // row_len`` at a time into micro-batches. Every
   micro-batch then has the same static shape ``[token_budget // row_len, row_len]``, so the train
   step compiles once per ``row_len`` bucket, not once per step.
3. ``layout(sequences, plan)``: the ``TokenBatch`` arrays the model consumes. Within a row, each sequence
   gets its own segment id (1, 2, ...; 0 is padding) and positions restarting at 0, so packed sequences
   never attend to each other (see ``asyncrl_jax.models.transformer``).

Per-token fields are aligned with the token they describe: ``behav_logp[t]`` is the log-prob of
``tokens[t]`` given the tokens before it; ``mask[t]`` is 1 if ``tokens[t]`` was sampled by the policy.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

from asyncrl_jax.infra import bucketing

DEFAULT_ROW_BUCKETS = bucketing.ROW_BUCKETS


class PackingError(ValueError):
  """A sequence cannot be packed as asked."""


def pack(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
  """First-fit-decreasing bin packing of sequence indices under a token budget.

  Args:
    lengths: length of each sequence (>= 1).
    token_budget: capacity of a bin in tokens.

  Returns:
    Bins as lists of indices into ``lengths``; every index appears exactly once; each bin's total
    length is <= ``token_budget``. Ties are broken by index, so the result is deterministic.

  Raises:
    PackingError: a sequence is longer than the budget (or has length < 1).
  """
  if token_budget < 1:
    raise PackingError(f"token_budget={token_budget} must be >= 1")
  lengths = [int(n) for n in lengths]
  for i, n in enumerate(lengths):
    if n < 1:
      raise PackingError(f"sequence {i} has length {n}; lengths must be >= 1")
    if n > token_budget:
      raise PackingError(f"sequence {i} has {n} tokens, more than the token budget {token_budget}; "
                         "raise learner.token_budget or cap the completion length")
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  bins: list[list[int]] = []
  free: list[int] = []
  for i in order:
    n = lengths[i]
    for b, room in enumerate(free):
      if room >= n:
        bins[b].append(i)
        free[b] -= n
        break
    else:
      bins.append([i])
      free.append(token_budget - n)
  return bins


def bucket(n: int, buckets: Sequence[int] = DEFAULT_ROW_BUCKETS) -> int:
  """Smallest bucket >= n (``bucketing.bucket``), as a PackingError when none holds it."""
  try:
    return bucketing.bucket(n, buckets)
  except bucketing.BucketError as e:
    raise PackingError(str(e)) from None


class MicroBatchPlan(NamedTuple):
  """``micro_batches[m][r]`` lists the sequence indices in row ``r`` of micro-batch ``m``."""
  micro_batches: list[list[list[int]]]
  rows: int  # rows per micro-batch
  row_len: int


def plan_micro_batches(lengths: Sequence[int], token_budget: int, *, row_len: Optional[int] = None,
                       buckets: Sequence[int] = DEFAULT_ROW_BUCKETS) -> MicroBatchPlan:
  """Packs sequences into rows of ``row_len`` (FFD), then groups rows into fixed-shape micro-batches.

  ``row_len`` defaults to the bucket of the longest sequence. Each micro-batch has
  ``max(1, token_budget // row_len)`` rows (the last one is completed with empty rows), so every
  micro-batch holds at most ``token_budget`` tokens and all share one shape.
  """
  if not len(lengths):
    raise PackingError("no sequences to pack")
  row_len = row_len or bucket(max(lengths), buckets)
  if token_budget < row_len:
    raise PackingError(f"token_budget={token_budget} is smaller than one row of {row_len} tokens")
  rows = pack(lengths, row_len)
  # Rows come out longest-first; keep them in that order so micro-batches are similarly full.
  per_mb = max(1, token_budget // row_len)
  mbs = [rows[i:i + per_mb] for i in range(0, len(rows), per_mb)]
  return MicroBatchPlan(mbs, per_mb, row_len)


ROUTE_DTYPE = np.int16  # a mixture-of-experts policy's recorded experts (``models.moe.ROUTE_DTYPE``)


class SequenceData(NamedTuple):
  """One trajectory as the learner sees it; every field has one entry per token."""
  tokens: np.ndarray  # int32 [n]: prompt + completion
  mask: np.ndarray  # float32 [n]: 1 on sampled (policy) tokens
  behav_logp: np.ndarray  # float32 [n]
  advantages: np.ndarray  # float32 [n]
  versions: np.ndarray  # int32 [n]: policy version that sampled the token (-1 off policy tokens)
  loss_weight: Optional[np.ndarray] = None  # float32 [n]: per-token weight of the loss; None: 1
  # float32 [n]: 1 where the token was sampled with the stop tokens banned (a minimum length); None: 0
  eos_banned: Optional[np.ndarray] = None
  # int16 [n, L_moe, k]: the experts the decode server routed each token to (routing replay); None:
  # not recorded
  routes: Optional[np.ndarray] = None


def make_sequence(prompt, completion, *, logprobs=None, versions=None, advantage: float = 0.0,
                  token_reward=None, min_new_tokens: int = 0,
                  weight: float = 1.0, action_mask=None, routes=None) -> SequenceData:
  """Prompt + completion as one ``SequenceData``: the completion tokens are the policy tokens.

  ``logprobs`` / ``versions`` (one per completion token) default to 0 / -1 (supervised data);
  ``advantage`` is broadcast over the completion. ``token_reward`` (value advantages, see
  ``asyncrl_jax.learner.critic``) instead puts the trajectory's reward on its last token, 0 elsewhere
  (or, an array, gives each completion token's reward: an episode's turn rewards): the
  ``advantages`` field then holds per-token rewards, which the learner's critic turns into advantages.
  ``min_new_tokens``: the first that many completion tokens were sampled with the stop tokens banned
  (``eos_banned``; None when 0). ``weight``: the loss weight of every token (``loss_weight``; None
  when 1), e.g. 0 for a completion the overlong filter excludes. ``action_mask`` (one per completion
  token; None: all 1): completion tokens the policy did not sample (an environment's observation)
  are context, like the prompt: mask 0, so no loss, no advantage and no count. ``routes``
  (``[p + c, L_moe, k]``, prompt and completion): a mixture-of-experts policy's recorded experts.
  """
  p, c = len(prompt), len(completion)
  actions = np.ones(c) if action_mask is None else np.asarray(action_mask, np.float32)
  if len(actions) != c:
    raise ValueError(f"{c} completion tokens but an action mask of {len(actions)}")
  mask = np.r_[np.zeros(p), actions].astype(np.float32)
  if token_reward is None:
    per_token = mask * advantage
  else:
    if advantage:
      raise ValueError("give an advantage or a token_reward, not both")
    per_token = np.zeros(p + c)
    if np.ndim(token_reward):  # one per completion token (an episode's turn rewards)
      if len(token_reward) != c:
        raise ValueError(f"{c} completion tokens but {len(token_reward)} token rewards")
      per_token[p:] = token_reward
    else:
      per_token[-1] = token_reward
  return SequenceData(
      tokens=np.r_[np.asarray(prompt), np.asarray(completion)].astype(np.int32), mask=mask,
      behav_logp=np.r_[np.zeros(p), np.zeros(c) if logprobs is None else logprobs].astype(np.float32),
      advantages=per_token.astype(np.float32),
      versions=np.r_[np.full(p, -1), np.full(c, -1) if versions is None else versions].astype(np.int32),
      loss_weight=None if weight == 1.0 else np.full(p + c, weight, np.float32),
      eos_banned=(np.r_[np.zeros(p), np.arange(c) < min_new_tokens].astype(np.float32)
                  if min_new_tokens else None),
      routes=None if routes is None else np.asarray(routes, ROUTE_DTYPE))


def episode_token_rewards(turns: list, n: int, extra: float = 0.0) -> np.ndarray:
  """An episode's reward per completion token (``n`` of them) for the critic: each turn's reward on
  its action's last token (what GAE over the action tokens credits), ``extra`` (e.g. a length
  penalty) on the last token."""
  out = np.zeros(n, np.float32)
  for turn in turns:
    start, end = turn.action
    if end > start:
      out[end - 1] += turn.reward
  if n:
    out[-1] += extra
  return out


def with_staleness(seq: SequenceData, version: int) -> SequenceData:
  """``seq`` with ``versions`` replaced by each policy token's staleness, ``version - versions`` (-1
  off the policy tokens): what the learner puts on device, where only the selection monitor reads it
  (``rl.selection.device_counts``) and the version being trained is not otherwise known."""
  return seq._replace(versions=np.where(seq.mask > 0, version - seq.versions, -1).astype(np.int32))


class TokenBatch(NamedTuple):
  """Packed arrays, all ``[R, L]`` (``routes`` ``[R, L, L_moe, k]``); segment id 0 marks padding."""
  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  mask: np.ndarray
  behav_logp: np.ndarray
  advantages: np.ndarray
  versions: np.ndarray  # the sampling policy's version; the learner places staleness (with_staleness)
  loss_weight: np.ndarray  # 1 unless the aggregation weighs tokens (see weight_sequences_equally)
  eos_banned: np.ndarray  # 1 where the stop tokens were banned when the token was sampled
  # int16: the recorded experts per token and MoE layer (padding: experts 0..k-1); None: not recorded
  routes: Optional[np.ndarray] = None


def _check_sequence(i: int, s: SequenceData) -> int:
  n = len(s.tokens)
  for name in SequenceData._fields:
    if getattr(s, name) is not None and len(getattr(s, name)) != n:
      raise PackingError(f"sequence {i}: field {name} has {len(getattr(s, name))} entries, "
                         f"tokens has {n}")
  if n and s.mask[0]:
    raise PackingError(f"sequence {i}: the first token has no context, so it cannot be a policy "
                       "token (mask[0] must be 0)")
  return n


def layout_rows(sequences: Sequence[SequenceData], rows: Sequence[Sequence[int]], num_rows: int,
                row_len: int) -> TokenBatch:
  """Builds one ``[num_rows, row_len]`` TokenBatch from rows of sequence indices."""
  if len(rows) > num_rows:
    raise PackingError(f"{len(rows)} rows do not fit a micro-batch of {num_rows}")
  shape = (num_rows, row_len)
  out = TokenBatch(tokens=np.zeros(shape, np.int32), positions=np.zeros(shape, np.int32),
                   segment_ids=np.zeros(shape, np.int32), mask=np.zeros(shape, np.float32),
                   behav_logp=np.zeros(shape, np.float32), advantages=np.zeros(shape, np.float32),
                   versions=np.full(shape, -1, np.int32), loss_weight=np.zeros(shape, np.float32),
                   eos_banned=np.zeros(shape, np.float32), routes=_empty_routes(sequences, rows, shape))
  for r, row in enumerate(rows):
    start = 0
    for seg, i in enumerate(row, start=1):
      s = sequences[i]
      n = _check_sequence(i, s)
      if start + n > row_len:
        raise PackingError(f"row {r} overflows {row_len} tokens at sequence {i}")
      sl = slice(start, start + n)
      out.tokens[r, sl] = s.tokens
      out.positions[r, sl] = np.arange(n)
      out.segment_ids[r, sl] = seg
      out.mask[r, sl] = s.mask
      out.behav_logp[r, sl] = s.behav_logp
      out.advantages[r, sl] = s.advantages
      out.versions[r, sl] = s.versions
      out.loss_weight[r, sl] = 1.0 if s.loss_weight is None else s.loss_weight
      out.eos_banned[r, sl] = 0.0 if s.eos_banned is None else s.eos_banned
      if out.routes is not None:
        out.routes[r, sl] = s.routes
      start += n
  return out


def _empty_routes(sequences, rows, shape) -> Optional[np.ndarray]:
  """The routes array of a micro-batch whose sequences carry routes (all of them, of one shape),
  each token routed to experts 0..k-1 until filled; None when none carries routes."""
  members = [sequences[i] for row in rows for i in row]
  have = [s.routes is not None for s in members]
  if not any(have):
    return None
  if not all(have):
    raise PackingError(f"{have.count(False)} of {len(have)} sequences of a micro-batch have no routes; "
                       "routing replay needs every sequence's")
  per_token = {tuple(np.shape(s.routes)[1:]) for s in members}
  if len(per_token) != 1 or len(next(iter(per_token))) != 2:
    raise PackingError(f"sequences of a micro-batch carry routes of shapes {sorted(per_token)} per token; "
                       "expected one [L_moe, k]")
  layers, k = next(iter(per_token))
  return np.broadcast_to(np.arange(k, dtype=ROUTE_DTYPE), (*shape, layers, k)).copy()


def layout(sequences: Sequence[SequenceData], plan: MicroBatchPlan) -> list[TokenBatch]:
  """All micro-batches of a plan, each ``[plan.rows, plan.row_len]``."""
  return [layout_rows(sequences, mb, plan.rows, plan.row_len) for mb in plan.micro_batches]


def pack_sequences(sequences: Sequence[SequenceData], token_budget: int, *,
                   row_len: Optional[int] = None) -> list[TokenBatch]:
  """``plan_micro_batches`` + ``layout`` in one call."""
  plan = plan_micro_batches([len(s.tokens) for s in sequences], token_budget, row_len=row_len)
  return layout(sequences, plan)


def padded_micro_batches(sequences: Sequence[SequenceData], batch_rows: int, *,
                         buckets: Sequence[int] = DEFAULT_ROW_BUCKETS) -> list[TokenBatch]:
  """The baseline: fixed-size micro-batches of ``batch_rows`` sequences, one per row, padded to the
  bucket of the micro-batch's longest member (in input order)."""
  out = []
  for start in range(0, len(sequences), batch_rows):
    idx = list(range(start, min(start + batch_rows, len(sequences))))
    row_len = bucket(max(len(sequences[i].tokens) for i in idx), buckets)
    out.append(layout_rows(sequences, [[i] for i in idx], batch_rows, row_len))
  return out


def pad_rows(batch: TokenBatch, multiple: int) -> TokenBatch:
  """Adds empty rows so the row count divides over the mesh's batch axes."""
  rows = batch.tokens.shape[0]
  extra = -rows % multiple
  if not extra:
    return batch
  def pad(name, x):
    if x is None:
      return None
    if name == "routes":
      return np.concatenate([x, np.broadcast_to(x[:1] * 0 + np.arange(x.shape[-1], dtype=x.dtype),
                                                (extra,) + x.shape[1:])])
    return np.concatenate([x, np.full((extra,) + x.shape[1:], -1 if name == "versions" else 0, x.dtype)])

  return TokenBatch(*[pad(name, x) for name, x in zip(TokenBatch._fields, batch)])


def total_policy_tokens(batches: Sequence[TokenBatch]) -> float:
  """The global normalizer: policy tokens over all micro-batches of one global batch."""
  return float(sum(np.sum(b.mask) for b in batches))


def weight_sequences_equally(sequences: Sequence[SequenceData]) -> list[SequenceData]:
  """Per-token loss weights that turn the token-mean loss into a mean over sequences.

  Sequence ``i`` with ``n_i`` policy tokens gets ``loss_weight = (T / N) / n_i``, where ``T`` is the
  policy-token total and ``N`` the number of sequences with policy tokens. Divided by the usual
  normaliser ``T``, token ``t`` of sequence ``i`` then weighs ``1 / (N n_i)``: each sequence contributes
  the mean of its tokens, and sequences count equally whatever their length. Advantages are untouched;
  a weight a sequence already has (e.g. 0 from the overlong filter) multiplies in, and such a sequence
  still counts in ``N``, as a dropped token stays in the token mean's normaliser.
  """
  counts = [float(np.sum(s.mask)) for s in sequences]
  live = [n for n in counts if n > 0]
  if not live:
    return list(sequences)
  per_sequence = sum(live) / len(live)
  return [s._replace(loss_weight=np.float32(per_sequence / n) * (
      np.ones(len(s.tokens), np.float32) if s.loss_weight is None else s.loss_weight)) if n > 0 else s
          for s, n in zip(sequences, counts)]
