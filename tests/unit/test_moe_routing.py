"""plan_dispatch / expert_capacity against the paper's routing algorithms (V-MoE §2.4, App. C.1)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.models.moe import routing
from moe_reference import (buffers_to_plan_arrays, plan_buffers, plan_dispatch_by_sort_jit,
                           plan_dispatch_jit, route_reference)


def _plan(gates, **kwargs):
  return plan_dispatch_jit(jnp.asarray(gates, jnp.float32), **kwargs)


def _assert_plan_matches_reference(plan, gates, k, capacity, batch_priority, priority):
  gates = np.asarray(gates, np.float32)
  num_groups, num_patches, num_experts = gates.shape
  assert plan.num_experts == num_experts and plan.capacity == capacity and plan.k == k
  assert plan.slot_of_assignment.shape == (num_groups, num_patches * k)
  assert plan.assignment_of_slot.shape == (num_groups, num_experts * capacity)
  assert plan.combine_weights.shape == (num_groups, num_patches, k)
  for g in range(num_groups):
    buffers = route_reference(gates[g], k, capacity, batch_priority, priority)
    want_slot, want_assign, want_w = buffers_to_plan_arrays(buffers, num_patches, k, capacity)
    # Which (patch, choice) pairs each expert processes, in buffer order.
    assert plan_buffers(plan, g) == [[(p, i) for p, i, _ in b] for b in buffers], f"group {g}"
    np.testing.assert_array_equal(np.asarray(plan.slot_of_assignment[g]), want_slot)
    np.testing.assert_array_equal(np.asarray(plan.assignment_of_slot[g]), want_assign)
    np.testing.assert_allclose(np.asarray(plan.combine_weights[g]), want_w, rtol=0, atol=0)
    np.testing.assert_array_equal(np.asarray(plan.kept[g]), want_slot.reshape(-1, k) <
                                  num_experts * capacity)
    np.testing.assert_array_equal(np.asarray(plan.expert_of_slot_filled[g]),
                                  [len(b) for b in buffers])


# ------------------------------------------------------------------------------------------------
# (a) Small cases worked out by hand from Algorithms 1 and 2.
# Assignment a = patch * k + choice; slot = expert * C + position; dropped = E * C; empty = S * k.
# ------------------------------------------------------------------------------------------------

HAND_CASES = {
    # k=1, C=1, vanilla: patch 2 wants expert 0, already taken by patch 0 -> dropped.
    "k1_vanilla_overflow": dict(
        gates=[[0.6, 0.3, 0.1],
               [0.2, 0.7, 0.1],
               [0.5, 0.1, 0.4],
               [0.1, 0.2, 0.7]],
        k=1, capacity=1, batch_priority=False, priority="max",
        slot_of_assignment=[0, 1, 3, 2],
        assignment_of_slot=[0, 1, 3],
        combine_weights=[[0.6], [0.7], [0.0], [0.7]]),
    # k=2, C=2, vanilla. Round i=1 (TOP-1): e0 <- p0; e1 <- p1, p2 (full); e2 <- p3.
    # Round i=2 (TOP-2): p0 -> e1 is full: p0's TOP-2 is dropped although p0 comes first, because
    # the TOP-1 choices of the later patches p1, p2 went first. p1 -> e2 (pos 1), p2 -> e0 (pos 1),
    # p3 -> e0 is now full: dropped.
    "k2_vanilla_top1_before_top2": dict(
        gates=[[0.5, 0.4, 0.1],
               [0.1, 0.6, 0.3],
               [0.2, 0.7, 0.1],
               [0.3, 0.1, 0.6]],
        k=2, capacity=2, batch_priority=False, priority="max",
        slot_of_assignment=[0, 6, 2, 5, 3, 1, 4, 6],
        assignment_of_slot=[0, 5, 2, 4, 6, 3],
        combine_weights=[[0.5, 0.0], [0.6, 0.3], [0.7, 0.2], [0.6, 0.0]]),
    # Same patches without BPR: p0 (score .55) takes e0, the later p2 (score .9) is dropped.
    "k1_vanilla_keeps_early_low_score": dict(
        gates=[[0.55, 0.45],
               [0.30, 0.70],
               [0.90, 0.10]],
        k=1, capacity=1, batch_priority=False, priority="max",
        slot_of_assignment=[0, 1, 2],
        assignment_of_slot=[0, 1],
        combine_weights=[[0.55], [0.7], [0.0]]),
    # BPR: order p2 (.9), p1 (.7), p0 (.55): the early low-score p0 loses e0 to the later p2.
    "k1_bpr_late_high_score_wins": dict(
        gates=[[0.55, 0.45],
               [0.30, 0.70],
               [0.90, 0.10]],
        k=1, capacity=1, batch_priority=True, priority="max",
        slot_of_assignment=[2, 1, 0],
        assignment_of_slot=[2, 1],
        combine_weights=[[0.0], [0.7], [0.9]]),
    # BPR, k=2, score = max: p1 (.6) before p0 (.5). TOP-1: e0 <- p1, p0 dropped.
    # TOP-2: p1 -> e2, p0 -> e1.
    "k2_bpr_max": dict(
        gates=[[0.50, 0.45, 0.05],
               [0.60, 0.10, 0.30]],
        k=2, capacity=1, batch_priority=True, priority="max",
        slot_of_assignment=[3, 1, 0, 2],
        assignment_of_slot=[2, 1, 3],
        combine_weights=[[0.0, 0.45], [0.6, 0.3]]),
    # Same gates, score = sum of TOP-2: p0 (.95) before p1 (.9), so p0 keeps e0 instead.
    "k2_bpr_sum": dict(
        gates=[[0.50, 0.45, 0.05],
               [0.60, 0.10, 0.30]],
        k=2, capacity=1, batch_priority=True, priority="sum",
        slot_of_assignment=[0, 1, 3, 2],
        assignment_of_slot=[0, 1, 3],
        combine_weights=[[0.5, 0.45], [0.0, 0.3]]),
    # BPR still puts every TOP-1 before any TOP-2 (it sorts patches, not patch-expert pairs): the
    # high-score p0's TOP-2 (e1, .35) loses to the low-score p1's TOP-1 (e1, .5).
    "k2_bpr_top1_of_low_score_beats_top2_of_high_score": dict(
        gates=[[0.60, 0.35, 0.05],
               [0.05, 0.50, 0.45]],
        k=2, capacity=1, batch_priority=True, priority="max",
        slot_of_assignment=[0, 3, 1, 2],
        assignment_of_slot=[0, 2, 3],
        combine_weights=[[0.6, 0.0], [0.5, 0.45]]),
    # Capacity 2 with a partly empty buffer: e1 receives nobody -> its slots hold S*k = 5.
    "k1_empty_expert_padding": dict(
        gates=[[0.7, 0.1, 0.2],
               [0.2, 0.1, 0.7],
               [0.6, 0.1, 0.3],
               [0.8, 0.1, 0.1],
               [0.3, 0.1, 0.6]],
        k=1, capacity=2, batch_priority=False, priority="max",
        slot_of_assignment=[0, 4, 1, 6, 5],
        assignment_of_slot=[0, 2, 5, 5, 1, 4],
        combine_weights=[[0.7], [0.7], [0.6], [0.0], [0.6]]),
}


@pytest.mark.parametrize("name", sorted(HAND_CASES))
def test_hand_checked_cases(name):
  case = HAND_CASES[name]
  gates = np.asarray([case["gates"]], np.float32)  # one group
  kwargs = {key: case[key] for key in ("k", "capacity", "batch_priority", "priority")}
  # The literal-loop reference reproduces the hand-written buffers ...
  buffers = route_reference(gates[0], **kwargs)
  ref_slot, ref_assign, ref_w = buffers_to_plan_arrays(
      buffers, gates.shape[1], case["k"], case["capacity"])
  np.testing.assert_array_equal(ref_slot, case["slot_of_assignment"])
  np.testing.assert_array_equal(ref_assign, case["assignment_of_slot"])
  np.testing.assert_allclose(ref_w, np.float32(case["combine_weights"]))
  # ... and so does plan_dispatch.
  plan = _plan(gates, **kwargs)
  np.testing.assert_array_equal(np.asarray(plan.slot_of_assignment[0]), case["slot_of_assignment"])
  np.testing.assert_array_equal(np.asarray(plan.assignment_of_slot[0]), case["assignment_of_slot"])
  np.testing.assert_allclose(np.asarray(plan.combine_weights[0]),
                             np.float32(case["combine_weights"]), rtol=0, atol=0)


def test_vanilla_and_bpr_differ_only_in_order():
  """Both hand cases above route the same gates; BPR must change who is dropped."""
  gates = np.asarray([HAND_CASES["k1_bpr_late_high_score_wins"]["gates"]], np.float32)
  vanilla = _plan(gates, k=1, capacity=1, batch_priority=False)
  bpr = _plan(gates, k=1, capacity=1, batch_priority=True)
  np.testing.assert_array_equal(np.asarray(vanilla.slot_of_assignment[0]) < 2, [True, True, False])
  np.testing.assert_array_equal(np.asarray(bpr.slot_of_assignment[0]) < 2, [False, True, True])


# ------------------------------------------------------------------------------------------------
# (b) Randomized comparison with the literal-loop reference.
# ------------------------------------------------------------------------------------------------

# (seed, groups, tokens S, experts E, k, capacity, batch_priority, priority)
RANDOM_CONFIGS = [
    (0, 3, 1, 2, 1, 1, False, "max"),     # a single token
    (1, 3, 5, 3, 1, 1, True, "max"),
    (2, 4, 8, 4, 2, 2, False, "max"),
    (3, 4, 8, 4, 2, 2, True, "sum"),
    (4, 2, 16, 4, 2, 16, False, "max"),   # capacity = S: nothing can be dropped
    (5, 2, 16, 4, 2, 40, True, "sum"),    # capacity > S*k
    (6, 3, 13, 5, 3, 1, False, "max"),    # tiny capacity
    (7, 3, 13, 5, 3, 3, True, "sum"),
    (8, 2, 33, 7, 3, 4, False, "max"),
    (9, 2, 33, 7, 3, 5, True, "max"),
]


@pytest.mark.parametrize("seed,groups,tokens,experts,k,capacity,batch_priority,priority",
                         RANDOM_CONFIGS)
def test_matches_paper_algorithms_on_random_gates(seed, groups, tokens, experts, k, capacity,
                                                  batch_priority, priority):
  rng = np.random.default_rng(seed)
  kwargs = dict(k=k, capacity=capacity, batch_priority=batch_priority, priority=priority)
  # Continuous softmax gates (no ties), with a skew so that some experts are popular.
  logits = rng.normal(size=(groups, tokens, experts)) * 2.0 + rng.normal(size=experts)
  gates = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  gates = gates.astype(np.float32)
  _assert_plan_matches_reference(_plan(gates, **kwargs), gates, **kwargs)
  # Coarse gates in multiples of 1/8: many exact ties in the TOP-k and in the BPR score
  # (documented tie-breaks: lower expert id first, then natural patch order).
  coarse = (rng.integers(0, 5, size=(groups, tokens, experts)) / 8).astype(np.float32)
  _assert_plan_matches_reference(_plan(coarse, **kwargs), coarse, **kwargs)


def test_groups_are_routed_independently():
  """Routing one group must not depend on the other groups of the batch."""
  rng = np.random.default_rng(42)
  gates = rng.dirichlet(np.ones(4), size=(4, 8)).astype(np.float32)
  kwargs = dict(k=2, capacity=2, batch_priority=True, priority="sum")  # compiled for RANDOM_CONFIGS
  plan = _plan(gates, **kwargs)
  swapped = _plan(gates[::-1].copy(), **kwargs)
  np.testing.assert_array_equal(np.asarray(plan.slot_of_assignment),
                                np.asarray(swapped.slot_of_assignment)[::-1])
  np.testing.assert_array_equal(np.asarray(plan.assignment_of_slot),
                                np.asarray(swapped.assignment_of_slot)[::-1])


def test_plan_is_a_partial_bijection():
  rng = np.random.default_rng(3)
  g, s, e, k, c = 3, 13, 5, 3, 3
  gates = rng.dirichlet(np.ones(e) * 0.5, size=(g, s)).astype(np.float32)
  plan = _plan(gates, k=k, capacity=c, batch_priority=True, priority="sum")
  slot_of_a = np.asarray(plan.slot_of_assignment)
  a_of_slot = np.asarray(plan.assignment_of_slot)
  for gi in range(g):
    for a, slot in enumerate(slot_of_a[gi]):
      if slot < e * c:
        assert a_of_slot[gi, slot] == a
    for slot, a in enumerate(a_of_slot[gi]):
      if a < s * k:
        assert slot_of_a[gi, a] == slot
        # The slot belongs to the expert this assignment chose.
        assert slot // c == np.argsort(-gates[gi, a // k], kind="stable")[a % k]
    # Buffers are filled from position 0 without holes.
    filled = (a_of_slot[gi] < s * k).reshape(e, c)
    assert (np.diff(filled.astype(int), axis=1) <= 0).all()


def test_combine_weights_gradient_reaches_kept_gates_only():
  """g(x) = TOP_k(softmax(.)): d(sum of combine weights)/d(gates) is 1 on kept TOP-k entries."""
  gates = np.asarray([HAND_CASES["k2_vanilla_top1_before_top2"]["gates"]], np.float32)
  grad = jax.grad(lambda g: _plan(g, k=2, capacity=2).combine_weights.sum())(jnp.asarray(gates))
  want = np.zeros_like(gates)
  # Kept assignments of that case: p0->e0, p1->e1, p1->e2, p2->e1, p2->e0, p3->e2.
  for p, e in [(0, 0), (1, 1), (1, 2), (2, 1), (2, 0), (3, 2)]:
    want[0, p, e] = 1.0
  np.testing.assert_array_equal(np.asarray(grad), want)


# ------------------------------------------------------------------------------------------------
# Capacity.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,num_experts,k,ratio,want", [
    (16, 4, 1, 1.0, 4),        # k N P C / E = 4
    (16, 4, 2, 1.0, 8),
    (10, 4, 1, 1.0, 3),        # 2.5: half-way, rounds up (Python's round() would give 2)
    (6, 4, 1, 1.0, 2),         # 1.5 -> 2
    (14, 4, 1, 1.0, 4),        # 3.5 -> 4
    (100, 8, 2, 1.05, 26),     # 26.25 -> 26
    (16 * 49, 32, 2, 1.05, 51),  # 51.45 -> 51
    (1568, 32, 2, 0.5, 49),
    (10, 8, 1, 0.25, 1),       # 0.3125 -> 0, but at least one slot
    (5, 10, 1, 0.1, 1),        # 0.05 -> 0 -> 1
    (64, 8, 1, 0.55, 4),       # 4.4 -> 4
    (64, 8, 1, 0.57, 5),       # 4.56 -> 5
])
def test_expert_capacity_formula(num_tokens, num_experts, k, ratio, want):
  got = routing.expert_capacity(num_tokens, num_experts, k, ratio)
  assert isinstance(got, int)
  assert got == want


def test_expert_capacity_half_way_with_decimal_ratio():
  """k*N*C/E is exactly 10.5 (45 * 0.7 / 3) though binary floating point gives 10.4999..."""
  assert routing.expert_capacity(45, 3, 1, 0.7) == 11
  assert routing.expert_capacity(90, 3, 1, 0.35) == 11


def vmoe_compute_capacity(num_tokens, num_experts, capacity_factor, multiple_of=4):
  """A transcription of google-research/vmoe's vmoe/moe.py `compute_capacity` with its defaults
  (ceil_or_round="ceil", multiple_of=4); the dispatcher calls it with num_tokens = S * k."""
  capacity = int(math.ceil(num_tokens * capacity_factor / num_experts))
  if capacity < 1:
    raise ValueError(f"capacity {capacity} < 1")
  if multiple_of and multiple_of > 0:
    capacity += (-capacity) % multiple_of
  return capacity


@pytest.mark.parametrize("num_tokens,num_experts,k,ratio,want", [
    (32, 32, 2, 1.0, 4),         # the reference's own test: ceil(32 * 2 / 32) = 2 -> 4
    (16, 4, 1, 1.0, 4),          # 4, already a multiple of 4
    (16, 4, 2, 1.0, 8),
    (10, 4, 1, 1.0, 4),          # 2.5 -> 3 -> 4
    (100, 8, 2, 1.05, 28),       # 26.25 -> 27 -> 28 (paper: 26)
    (16 * 49, 32, 2, 1.05, 52),  # 51.45 -> 52
    (1568, 32, 2, 0.5, 52),      # 49 -> 52 (paper: 49)
    (10, 8, 1, 0.25, 4),         # 0.3125 -> 1 -> 4: the smallest capacity
    (5, 10, 1, 0.1, 4),
    (64, 8, 1, 0.57, 8),         # 4.56 -> 5 -> 8
    (100, 5, 2, 1.1, 48),        # 200 * 1.1 / 5 = 44.00000000000001 in floating point -> 45 -> 48
    (45, 3, 1, 0.7, 12),         # 10.499999999999998 -> 11 -> 12
    (197 * 8, 8, 2, 1.05, 416),  # ViT-B/16 at 224, group of 8 images: 413.7 -> 414 -> 416
])
def test_expert_capacity_reference_rounding(num_tokens, num_experts, k, ratio, want):
  got = routing.expert_capacity(num_tokens, num_experts, k, ratio, "reference")
  assert isinstance(got, int)
  assert got == want == vmoe_compute_capacity(num_tokens * k, num_experts, ratio)
  assert got % 4 == 0


def test_expert_capacity_reference_rounding_matches_vmoe_on_a_grid():
  for num_tokens in (1, 7, 49, 50, 65, 197, 200, 394, 1568):
    for num_experts in (2, 3, 5, 8, 32):
      for k in (1, 2, 5):
        for ratio in (0.1, 0.25, 0.5, 0.55, 0.7, 1.0, 1.05, 1.1, 1.25, 2.0):
          want = vmoe_compute_capacity(num_tokens * k, num_experts, ratio)
          assert routing.expert_capacity(num_tokens, num_experts, k, ratio, "reference") == want
  with pytest.raises(ValueError, match="unknown capacity rounding 'floor'"):
    routing.expert_capacity(16, 4, 1, 1.0, "floor")


@pytest.mark.parametrize("batch_priority", [False, True])
def test_nothing_dropped_when_capacity_reaches_tokens_per_group(batch_priority):
  """An expert appears at most once in a token's TOP-k, so C = S slots always suffice (this is
  what capacity ratio C = E / k gives), even when every token picks the same experts."""
  s, e, k = 6, 3, 2
  assert routing.expert_capacity(s, e, k, e / k) == s
  rng = np.random.default_rng(0)
  collapsed = np.tile(np.float32([0.7, 0.2, 0.1]), (2, s, 1))
  random_gates = rng.dirichlet(np.ones(e), size=(2, s)).astype(np.float32)
  for gates in (collapsed, random_gates):
    plan = _plan(gates, k=k, capacity=s, batch_priority=batch_priority)
    assert bool(plan.kept.all())
    top = -np.sort(-gates, axis=-1)[..., :k]
    np.testing.assert_array_equal(np.asarray(plan.combine_weights), top)
  # One slot fewer than S: with every token on the same TOP-1 expert, exactly one TOP-1 is dropped.
  plan = _plan(collapsed, k=k, capacity=s - 1, batch_priority=batch_priority)
  assert int((~plan.kept[..., 0]).sum()) == 2  # one per group


def test_dropping_grows_as_capacity_shrinks():
  """Buffers fill independently per expert in priority order: for each expert, the kept set is the
  first min(C, demand) assignments, so kept(C) is a subset of kept(C + 1)."""
  rng = np.random.default_rng(7)
  g, s, e, k = 2, 24, 4, 2
  logits = rng.normal(size=(g, s, e)) + np.array([1.5, 0.5, 0.0, -1.0])  # imbalanced demand
  gates = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32)
  top_experts = np.argsort(-gates, axis=-1, kind="stable")[..., :k]
  demand = np.stack([(top_experts[gi] == ei).sum() for gi in range(g) for ei in range(e)])
  demand = demand.reshape(g, e)
  previous_kept, previous_fraction = None, None
  for capacity in (s, 8, 3, 1):
    plan = _plan(gates, k=k, capacity=capacity)
    kept = np.asarray(plan.slot_of_assignment).reshape(g, s, k) < e * capacity
    np.testing.assert_array_equal(np.asarray(plan.expert_of_slot_filled),
                                  np.minimum(demand, capacity))
    assert kept.sum() == np.minimum(demand, capacity).sum()
    fraction = 1.0 - kept.mean()
    if previous_kept is not None:
      assert not (kept & ~previous_kept).any(), "an assignment kept at lower capacity only"
      assert fraction >= previous_fraction
    previous_kept, previous_fraction = kept, fraction
  assert previous_fraction > 0.5  # capacity 1 drops most of the 48 assignments


@pytest.mark.parametrize("priority", ["max", "sum"])
def test_bpr_keeps_highest_scores_at_low_capacity(priority):
  rng = np.random.default_rng(11)
  g, s, e, k, capacity = 3, 32, 4, 2, 2  # capacity ratio 0.125 in the paper's terms
  gates = rng.dirichlet(np.ones(e) * 0.7, size=(g, s)).astype(np.float32)
  top = -np.sort(-gates, axis=-1)[..., :k]
  score = top[..., 0] if priority == "max" else top.sum(-1)
  top1_expert = np.argmax(gates, axis=-1)
  bpr = _plan(gates, k=k, capacity=capacity, batch_priority=True, priority=priority)
  vanilla = _plan(gates, k=k, capacity=capacity, batch_priority=False)
  kept1 = np.asarray(bpr.kept[..., 0])
  for gi in range(g):
    for ei in range(e):
      routed = top1_expert[gi] == ei
      kept_scores = score[gi][routed & kept1[gi]]
      dropped_scores = score[gi][routed & ~kept1[gi]]
      assert len(kept_scores) == min(capacity, routed.sum())
      if len(dropped_scores):
        assert kept_scores.min() >= dropped_scores.max()
  # Consequently BPR keeps at least as much TOP-1 routing weight as vanilla routing (for "max",
  # where the score is the TOP-1 weight), and here strictly more.
  if priority == "max":
    bpr_weight = np.asarray(bpr.combine_weights[..., 0]).sum(-1)
    vanilla_weight = np.asarray(vanilla.combine_weights[..., 0]).sum(-1)
    assert (bpr_weight >= vanilla_weight - 1e-6).all()
    assert bpr_weight.sum() > vanilla_weight.sum() + 0.1


# ------------------------------------------------------------------------------------------------
# Auxiliary losses (Appendix A.2) are in test_moe_auxiliary_losses.py.
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# (d) The plan by one-hot cumulative sums against the sort-based plan it replaced, field by field,
# and the NumPy loop of the paper's algorithms: ties, k = 1 and 2, BPR on and off with both
# priorities, both capacity roundings, drops, and the biased choice of loss-free balancing.
# ------------------------------------------------------------------------------------------------

def _gates_with_ties(rng, groups, tokens, experts):
  """Softmax gates with a skew, then rounded to multiples of 1/16: many exact ties."""
  logits = rng.normal(size=(groups, tokens, experts)) * 2.0 + rng.normal(size=experts)
  gates = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  return (np.round(gates * 16) / 16).astype(np.float32)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("batch_priority, priority", [(False, "max"), (True, "max"),
                                                      (True, "sum")])
@pytest.mark.parametrize("rounding, ratio", [("paper", 1.05), ("paper", 0.5),
                                             ("reference", 1.05), ("reference", 0.3)])
@pytest.mark.parametrize("biased", [False, True])
def test_the_cumulative_sum_plan_equals_the_sort_based_plan(k, batch_priority, priority, rounding,
                                                            ratio, biased):
  rng = np.random.default_rng(hash((k, batch_priority, priority, rounding, ratio)) % 2**32)
  groups, tokens, experts = 3, 24, 6
  gates = _gates_with_ties(rng, groups, tokens, experts)
  select = None
  if biased:  # loss-free balancing: TOP-k chosen on gates + bias, weights read from the gates
    select = jnp.asarray(gates + rng.choice([-0.125, 0.0, 0.125], size=experts), jnp.float32)
  capacity = routing.expert_capacity(tokens, experts, k, ratio, rounding)
  kwargs = dict(k=k, capacity=capacity, batch_priority=batch_priority, priority=priority)
  plan = plan_dispatch_jit(jnp.asarray(gates), select=select, **kwargs)
  before = plan_dispatch_by_sort_jit(jnp.asarray(gates), select=select, **kwargs)
  for field in ("slot_of_assignment", "assignment_of_slot", "combine_weights", "experts", "gates"):
    np.testing.assert_array_equal(np.asarray(getattr(plan, field)),
                                  np.asarray(getattr(before, field)), err_msg=field)
  for field in ("kept", "expert_of_slot_filled"):
    np.testing.assert_array_equal(np.asarray(getattr(plan, field)),
                                  np.asarray(getattr(before, field)), err_msg=field)
  assert (plan.num_experts, plan.capacity, plan.k) == (before.num_experts, before.capacity, k)
  if ratio < 1:  # fewer slots than assignments: the plans agree on what they drop
    assert np.any(~np.asarray(plan.kept))
  if not biased:  # the paper's loops choose on the gates themselves
    _assert_plan_matches_reference(plan, gates, **kwargs)


def test_the_plans_gradients_equal_the_sort_based_plans():
  rng = np.random.default_rng(3)
  gates = jnp.asarray(_gates_with_ties(rng, 2, 16, 4) + 0.01)
  target = jnp.asarray(rng.normal(size=(2, 16, 2)), jnp.float32)

  def loss(plan_fn):
    return lambda g: jnp.sum(plan_fn(g, k=2, capacity=5, batch_priority=True,
                                     priority="sum").combine_weights * target)
  np.testing.assert_array_equal(np.asarray(jax.grad(loss(plan_dispatch_jit))(gates)),
                                np.asarray(jax.grad(loss(plan_dispatch_by_sort_jit))(gates)))
