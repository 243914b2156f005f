"""Advantages: group-relative (GRPO-style), single-rollout value baseline, GAE; a clipped value loss.

Group-relative advantages need every member of a group, which reintroduces a barrier per prompt;
single-rollout advantages (``A = R - V``, SAO) do not, at the cost of a critic. Both are pure functions; the group ones run on the host (numpy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def group_advantages(rewards, group_ids, *, num_groups: int, scale_by_std: bool = False,
                     eps: float = 1e-6):
  """Reward minus its group's mean (optionally divided by the group's std), on the host (numpy): the
  controller computes these per batch, and they need no device.

  Args:
    rewards: [N] scalar reward per trajectory.
    group_ids: [N] int in [0, num_groups): trajectories of the same prompt share an id.
    num_groups: number of group ids.
    scale_by_std: divide by the group's population standard deviation (+ eps).
    eps: added to the std.

  Returns:
    (advantages [N] float32, group_count [N] int32): the count of members of each trajectory's group,
    so a caller can detect incomplete groups (compare with the expected group size) before trusting
    the baseline.
  """
  rewards = np.asarray(rewards, np.float32)
  group_ids = np.asarray(group_ids, np.int64)
  if group_ids.size and not 0 <= group_ids.min() <= group_ids.max() < num_groups:
    raise ValueError(f"group ids must lie in [0, {num_groups}); got {group_ids.min()}..{group_ids.max()}")
  counts = np.bincount(group_ids, minlength=num_groups).astype(np.float32)
  sums = np.bincount(group_ids, weights=rewards, minlength=num_groups).astype(np.float32)
  means = sums / np.maximum(counts, 1.0)
  centred = rewards - means[group_ids]
  if scale_by_std:
    var = np.bincount(group_ids, weights=centred * centred, minlength=num_groups).astype(np.float32)
    std = np.sqrt(var / np.maximum(counts, 1.0))
    centred = centred / (std[group_ids] + eps)
  return centred.astype(np.float32), counts[group_ids].astype(np.int32)


def incomplete_groups(group_ids, expected_size: int) -> list[int]:
  """Host-side check: ids of groups that do not have exactly ``expected_size`` members."""
  ids, counts = np.unique(np.asarray(group_ids), return_counts=True)
  return [int(i) for i, c in zip(ids, counts) if int(c) != expected_size]


def value_baseline_advantages(rewards, values):
  """Single-rollout advantage ``A = R - V(s_0)`` per trajectory: [N], [N] -> [N]."""
  return jnp.asarray(rewards, jnp.float32) - jnp.asarray(values, jnp.float32)


def broadcast_to_tokens(per_sequence, mask_bt):
  """[B] advantages -> [B, T], zero off the policy tokens."""
  return jnp.where(mask_bt > 0, jnp.asarray(per_sequence, jnp.float32)[:, None], 0.0)


def gae(rewards_bt, values_bt, mask_bt, terminated_b, bootstrap_b, *, gamma: float = 1.0,
        lam: float = 1.0, segment_ids_bt=None):
  """Generalised advantage estimation over the action tokens of each row.

  Only tokens with ``mask == 1`` are steps of the MDP; the scan skips the others (prompt, tool output,
  padding), carrying the next step's value and advantage across them. A reward placed on a skipped
  token is credited to the action before it. After a row's last action, the next value is 0 when the
  trajectory ``terminated`` (the episode ended) and ``bootstrap`` when it was truncated (cut off by a
  length or time budget, so the future is estimated by the critic).

    delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next

  Packed rows (``segment_ids_bt`` given, ``[B, T]``, 0 for padding): each segment is a trajectory of
  its own that ended there, terminated: nothing carries from one segment into the one before it;
  ``terminated_b`` / ``bootstrap_b`` apply only to a segment that runs to the row's last column.

  Args:
    rewards_bt: [B, T] rewards.
    values_bt: [B, T] critic values V(s_t) at action tokens.
    mask_bt: [B, T] 1 on action tokens.
    terminated_b: [B] bool, True if the trajectory ended naturally.
    bootstrap_b: [B] value of the state after the last token (used only when not terminated).
    gamma, lam: discount and GAE lambda.
    segment_ids_bt: optional [B, T] sequence of each token within a packed row.

  Returns:
    (advantages [B, T], returns [B, T]); both 0 off the action tokens. returns = A + V.
  """
  rewards_bt = jnp.asarray(rewards_bt, jnp.float32)
  values_bt = jnp.asarray(values_bt, jnp.float32)
  is_action = jnp.asarray(mask_bt) > 0
  next_value0 = jnp.where(jnp.asarray(terminated_b), 0.0, jnp.asarray(bootstrap_b, jnp.float32))

  def step(carry, xs):
    reward, value, action, ends = xs
    # the last token of a packed segment (not the row's last): a terminated trajectory ends here
    carry = jax.tree.map(lambda c: jnp.where(ends, 0.0, c), carry)
    next_value, next_adv, pending_reward = carry
    reward = reward + pending_reward
    delta = reward + gamma * next_value - value
    adv = delta + gamma * lam * next_adv
    new_carry = (jnp.where(action, value, next_value), jnp.where(action, adv, next_adv),
                 jnp.where(action, 0.0, reward))
    return new_carry, jnp.where(action, adv, 0.0)

  b = rewards_bt.shape[0]
  init = (next_value0, jnp.zeros(b, jnp.float32), jnp.zeros(b, jnp.float32))
  ends = jnp.zeros(rewards_bt.shape, bool)
  if segment_ids_bt is not None:
    seg = jnp.asarray(segment_ids_bt)
    ends = ends.at[:, :-1].set(seg[:, :-1] != seg[:, 1:])
  xs = (rewards_bt.T, values_bt.T, is_action.T, ends.T)  # scan over time
  _, adv_tb = jax.lax.scan(step, init, xs, reverse=True)
  adv = adv_tb.T
  return adv, jnp.where(is_action, adv + values_bt, 0.0)


def clipped_value_loss(values, old_values, returns, mask, *, clip_eps: float, normalizer=None):
  """PPO value loss ``0.5 * max((V - R)^2, (clip(V, V_old - e, V_old + e) - R)^2)``, summed over the
  tokens with ``mask`` and divided by ``normalizer`` (default: their count, a token mean; a whole
  batch's count makes micro-batch losses sum to the batch's token mean)."""
  mask = jnp.asarray(mask, jnp.float32)
  old_values = jax.lax.stop_gradient(old_values)
  clipped = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
  per_token = 0.5 * jnp.maximum(jnp.square(values - returns), jnp.square(clipped - returns))
  if normalizer is None:
    normalizer = jnp.maximum(jnp.sum(mask), 1.0)
  return jnp.sum(jnp.where(mask > 0, per_token, 0.0)) / normalizer
