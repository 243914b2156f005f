"""Which policy tokens the objective gave weight 0, by completion length and by token staleness.

DIS masks every token whose importance ratio leaves ``(1 - eps_low, 1 + eps_high)``; decoupled PPO's
cap and floor drop tokens too; any objective drops a token outside the learner's truncated (top-k /
top-p) set. If masking falls mostly on long completions, or on stale tokens, the update is trained on
a biased selection of the data (short, easy, fresh), which a falling reward alone does not show. This
counts, per version, the zeroed tokens in each completion-length bucket and each staleness bucket,
and the effective batch: the share of policy tokens that kept a weight.

The jitted step counts each micro-batch (``device_counts``: a few dozen numbers, replicated, not a
per-token view that every process would bring back whole); the host turns them into a ``Counter``
(``counts_of``), sums them over the version's micro-batches and updates (``Counter.update``), and
makes metrics (``selection_metrics``), only for buckets that hold tokens. ``selection_counts`` is the
same count in numpy, from the per-token view (the reference the tests hold the jitted one to).

The same counts give the ratio's picture per version (when the step passes the behaviour log-ratio
and the advantages): a histogram of ``log(pi_theta / pi_behav)`` over the policy tokens in bins of
``RATIO_BIN`` nats (quantiles ``ratio_p50`` / ``p90`` / ``p99`` are read off it, to within a bin:
~5% relative), and the zeroed and clipped tokens by the side of the ratio (``hi``: > 1, ``lo``: <= 1)
and the sign of the advantage (``pos`` / ``neg``; 0 counts as ``pos``): ``masked_frac_hi_neg`` is
the share of all policy tokens that drifted up since sampling, scored below their group, and were
given weight 0, the restoring signal that a sign-blind mask drops.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

# upper bounds (inclusive) of the completion-length buckets, in tokens; longer ones go to the last
LENGTH_BOUNDS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# staleness buckets (versions between the token's policy and the one being trained), inclusive
STALENESS_BUCKETS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16))
# the behaviour log-ratio histogram: bins of RATIO_BIN nats over [-RATIO_RANGE, RATIO_RANGE], plus one
# bin each side for everything beyond
RATIO_BIN, RATIO_RANGE = 0.05, 8.0
RATIO_EDGES = np.arange(-RATIO_RANGE, RATIO_RANGE + RATIO_BIN / 2, RATIO_BIN)
SIDES = ("hi_pos", "hi_neg", "lo_pos", "lo_neg")


def _length_key(n: np.ndarray) -> np.ndarray:
  return np.searchsorted(np.asarray(LENGTH_BOUNDS), n, side="left")


def length_bucket_name(i: int) -> str:
  if i < len(LENGTH_BOUNDS):
    lo = 1 if i == 0 else LENGTH_BOUNDS[i - 1] + 1
    return f"len_{lo}_{LENGTH_BOUNDS[i]}"
  return f"len_over_{LENGTH_BOUNDS[-1]}"


def staleness_bucket_name(i: int) -> str:
  if i < len(STALENESS_BUCKETS):
    lo, hi = STALENESS_BUCKETS[i]
    return f"stale_{lo}" if lo == hi else f"stale_{lo}_{hi}"
  return f"stale_over_{STALENESS_BUCKETS[-1][1]}"


def _staleness_key(s: np.ndarray) -> np.ndarray:
  highs = np.asarray([hi for _, hi in STALENESS_BUCKETS])
  return np.searchsorted(highs, s, side="left")


def selection_counts(zeroed, mask, versions, segment_ids, *, version: int) -> collections.Counter:
  """Counts of one micro-batch (all ``[R, L]``): per bucket, policy tokens (``("tokens", bucket)``)
  and zeroed ones (``("zeroed", bucket)``); buckets are ``("len", i)`` by the completion length
  (policy tokens) of the token's sequence and ``("stale", i)`` by ``version - versions``.

  Args:
    zeroed: 1 on policy tokens the objective gave weight 0.
    mask: 1 on policy tokens.
    versions: policy version that sampled each token.
    segment_ids: sequence of each token within its row (0: padding).
    version: the version being trained.
  """
  mask = np.asarray(mask) > 0
  zeroed = (np.asarray(zeroed) > 0) & mask
  segment_ids = np.asarray(segment_ids)
  rows, width = segment_ids.shape
  key = np.arange(rows)[:, None] * (width + 1) + segment_ids  # one id per (row, sequence)
  lengths = np.bincount(key.ravel(), weights=mask.ravel(), minlength=rows * (width + 1))[key]
  staleness = version - np.asarray(versions)
  out = collections.Counter()
  for kind, bucket in (("len", _length_key(lengths[mask])), ("stale", _staleness_key(staleness[mask]))):
    for b, n in zip(*np.unique(bucket, return_counts=True)):
      out[("tokens", (kind, int(b)))] += int(n)
    for b, n in zip(*np.unique(bucket[zeroed[mask]], return_counts=True)):
      out[("zeroed", (kind, int(b)))] += int(n)
  return out


def side_index(log_ratio, advantages):
  """Index into ``SIDES`` per token: ratio above 1 or not, advantage negative or not."""
  return 2 * (log_ratio <= 0).astype(jnp.int32) + (advantages < 0).astype(jnp.int32)


def device_counts(zeroed, mask, staleness, segment_ids, *, log_ratio=None, advantages=None,
                  clipped=None) -> dict:
  """Traceable ``selection_counts`` of one micro-batch (all ``[R, L]``; ``staleness``: the version
  trained minus the token's version): ``tokens_len`` / ``zeroed_len`` (float32 ``[len(LENGTH_BOUNDS)
  + 1]``), ``tokens_stale`` / ``zeroed_stale`` (``[len(STALENESS_BUCKETS) + 1]``). Exact while a
  micro-batch holds fewer than 2**24 tokens. With ``log_ratio`` (``log pi_theta - log pi_behav``) and
  ``advantages``: ``ratio_hist`` (``[len(RATIO_EDGES) + 1]``), ``tokens_side`` / ``zeroed_side`` /
  ``clipped_side`` (``[4]``, ``SIDES``; ``clipped``: 1 where PPO's clip stopped the gradient)."""
  mask = jnp.asarray(mask) > 0
  zeroed = (jnp.asarray(zeroed) > 0) & mask
  segment_ids = jnp.asarray(segment_ids)
  width = segment_ids.shape[1]
  # policy tokens of each token's sequence, row by row (a row's sequences are its own, so nothing
  # crosses the devices that hold the rows)
  lengths = jax.vmap(lambda m, seg: jax.ops.segment_sum(m, seg, num_segments=width + 1)[seg])(
      mask.astype(jnp.float32), segment_ids)
  length_bucket = jnp.searchsorted(jnp.asarray(LENGTH_BOUNDS, jnp.float32), lengths, side="left")
  highs = jnp.asarray([hi for _, hi in STALENESS_BUCKETS], jnp.int32)
  stale_bucket = jnp.searchsorted(highs, jnp.asarray(staleness, jnp.int32), side="left")

  def count(bucket, which, n):
    return jax.ops.segment_sum(which.ravel().astype(jnp.float32), bucket.ravel(), num_segments=n)

  n_len, n_stale = len(LENGTH_BOUNDS) + 1, len(STALENESS_BUCKETS) + 1
  out = dict(tokens_len=count(length_bucket, mask, n_len), zeroed_len=count(length_bucket, zeroed, n_len),
             tokens_stale=count(stale_bucket, mask, n_stale),
             zeroed_stale=count(stale_bucket, zeroed, n_stale))
  if log_ratio is not None:
    log_ratio = jnp.where(mask, log_ratio, 0.0)
    ratio_bin = jnp.searchsorted(jnp.asarray(RATIO_EDGES, jnp.float32), log_ratio, side="left")
    side = side_index(log_ratio, jnp.asarray(advantages))
    clipped = jnp.zeros_like(mask) if clipped is None else (jnp.asarray(clipped) > 0) & mask
    out.update(ratio_hist=count(ratio_bin, mask, len(RATIO_EDGES) + 1),
               tokens_side=count(side, mask, 4), zeroed_side=count(side, zeroed, 4),
               clipped_side=count(side, clipped, 4))
  return out


def counts_of(device: dict) -> collections.Counter:
  """``device_counts``' arrays (read back) as ``selection_counts``' ``Counter`` (and, when present,
  the ratio histogram as ``("ratio", ("bin", i))`` and the side counts as ``(what, ("side", i))``)."""
  out = collections.Counter()
  for kind in ("len", "stale", "side"):
    for what in ("tokens", "zeroed", "clipped"):
      for b, n in enumerate(np.asarray(device.get(f"{what}_{kind}", ()))):
        if n:
          out[(what, (kind, b))] += int(round(float(n)))
  for b, n in enumerate(np.asarray(device.get("ratio_hist", ()))):
    if n:
      out[("ratio", ("bin", b))] += int(round(float(n)))
  return out


def ratio_quantile(counts: collections.Counter, q: float) -> float:
  """The ``q`` quantile of the behaviour ratio from ``counts``' histogram: the upper edge of the bin
  that holds it (exp of it; the last bin's lower edge for everything beyond the range)."""
  hist = np.zeros(len(RATIO_EDGES) + 1)
  for (what, (_, b)), n in counts.items():
    if what == "ratio":
      hist[b] = n
  if not hist.sum():
    return float("nan")
  b = int(np.searchsorted(np.cumsum(hist), q * hist.sum(), side="left"))
  return float(np.exp(RATIO_EDGES[min(b, len(RATIO_EDGES) - 1)]))


def selection_metrics(counts: collections.Counter) -> dict:
  """``masked_frac_<bucket>`` for every bucket holding tokens, and ``effective_batch`` (policy tokens
  with a weight, over all policy tokens)."""
  out = {}
  for (what, bucket), n in sorted(counts.items(), key=str):
    if what != "tokens" or not n or bucket[0] == "side":
      continue
    kind, i = bucket
    name = length_bucket_name(i) if kind == "len" else staleness_bucket_name(i)
    out[f"masked_frac_{name}"] = counts[("zeroed", bucket)] / n
  # every policy token is in exactly one length bucket: their sums are the totals
  total = sum(n for (what, (kind, _)), n in counts.items() if what == "tokens" and kind == "len")
  zeroed = sum(n for (what, (kind, _)), n in counts.items() if what == "zeroed" and kind == "len")
  out["effective_batch"] = 1.0 - zeroed / total if total else 1.0
  side_total = sum(counts[("tokens", ("side", i))] for i in range(len(SIDES)))
  if side_total:  # shares of all policy tokens, so the four sides of each add up to the whole
    for i, name in enumerate(SIDES):
      out[f"masked_frac_{name}"] = counts[("zeroed", ("side", i))] / side_total
      out[f"clipped_frac_{name}"] = counts[("clipped", ("side", i))] / side_total
    for q in (50, 90, 99):
      out[f"ratio_p{q}"] = ratio_quantile(counts, q / 100)
  return out
