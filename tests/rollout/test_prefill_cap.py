"""A cap on the tokens of one batched-prefill call: no planned or compiled call exceeds it (a single
row excepted), and every busy slot is still prefilled exactly once (the engine's re-prefill under a
cap: tests/rollout/test_engine.py)."""

import numpy as np
import pytest

from asyncrl_jax.rollout.prefill_plan import prefill_plan, prefill_shapes


@pytest.mark.parametrize("cap", [64, 200, 1000])
def test_no_call_exceeds_the_cap_and_every_slot_is_prefilled_once(cap):
  rng = np.random.default_rng(0)
  for _ in range(20):
    lengths = rng.integers(0, 120, 16) * (rng.random(16) < 0.8)
    plan = prefill_plan(lengths, 16, 128, max_tokens=cap)
    slots = np.concatenate([g for g, _, _ in plan]) if plan else np.array([], int)
    assert sorted(slots) == sorted(np.flatnonzero(lengths > 0))
    for group, rows, width in plan:
      assert rows * width <= cap or rows == 1
      assert len(group) <= rows and width >= lengths[group].max()
  assert all(r * w <= cap or r == 1 for r, w in prefill_shapes(16, 128, cap))
  assert (1, 128) in prefill_shapes(16, 128, cap)  # a full-length row always has a shape


def test_without_a_cap_the_plan_is_unchanged():
  lengths = np.array([100, 90, 3, 0, 50, 120, 7, 7])
  assert [(list(g), r, w) for g, r, w in prefill_plan(lengths, 8, 128)] == \
      [(list(g), r, w) for g, r, w in prefill_plan(lengths, 8, 128, max_tokens=0)]
  full = prefill_plan(lengths, 8, 128, max_tokens=10**9)
  assert [(list(g), r, w) for g, r, w in full] == [(list(g), r, w) for g, r, w in prefill_plan(lengths, 8, 128)]
