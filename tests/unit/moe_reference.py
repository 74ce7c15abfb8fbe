"""Plain NumPy / Python references for the V-MoE routing tests (not collected by pytest).

Everything here is written from the V-MoE paper (arXiv:2106.05974), not from the code under test:
- `route_reference`: Appendix C.1, Algorithm 1 (vanilla) and Algorithm 2 (Batch Prioritized
  Routing), as literal loops over per-expert buffers.
- `importance_loss_reference`, `load_loss_reference`: Appendix A.2, eqs. (1)-(6).
- `plan_dispatch_by_sort`: vmoe's earlier, sort-based plan, against which today's is checked.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from runner.models.moe import routing

# One jitted entry point shared by all test modules of a process, so that each
# (shape, k, capacity, batch_priority, priority) combination compiles once.
plan_dispatch_jit = jax.jit(
    routing.plan_dispatch, static_argnames=("k", "capacity", "batch_priority", "priority"))


def plan_dispatch_by_sort(gates: jax.Array, *, k: int, capacity: int, batch_priority: bool = False,
                  priority: str = "max", select: jax.Array | None = None) -> routing.DispatchPlan:
  """vmoe's plan until 2026-12-07, kept as an independent reference for the one-hot cumulative
  sums that replaced it: assignments sorted by (expert, priority), each expert's run found by
  searchsorted, the sort inverted by a scatter."""
  if priority not in routing.PRIORITIES:
    raise ValueError(f"unknown routing priority {priority!r}; valid: {routing.PRIORITIES}")
  num_groups, num_tokens, num_experts = gates.shape
  weights, experts = routing.top_k_gates(gates, k, select)  # (G, S, k)
  if batch_priority:
    score = weights[..., 0] if priority == "max" else weights.sum(-1)
    # Rank of each token when sorted by decreasing score; stable, so ties keep token order.
    order = jnp.argsort(-score, axis=-1, stable=True)
    token_rank = jnp.argsort(order, axis=-1).astype(jnp.int32)
  else:
    token_rank = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (num_groups, num_tokens))
  choice = jnp.arange(k, dtype=jnp.int32)
  # Priority of assignment (t, i): all first choices before any second choice, then by rank.
  priority_key = choice[None, None, :] * num_tokens + token_rank[..., None]  # (G, S, k)
  num_assign = num_tokens * k
  experts_flat = experts.reshape(num_groups, num_assign).astype(jnp.int32)
  priority_flat = priority_key.reshape(num_groups, num_assign)
  assignment_ids = jnp.broadcast_to(jnp.arange(num_assign, dtype=jnp.int32), experts_flat.shape)
  # Sort assignments by (expert, priority): each expert's assignments become a contiguous run in
  # priority order, so an assignment's buffer position is its offset inside its run.
  sorted_experts, _, sorted_ids = jax.lax.sort(
      (experts_flat, priority_flat, assignment_ids), dimension=-1, num_keys=2)
  expert_range = jnp.arange(num_experts, dtype=jnp.int32)
  run_start = jax.vmap(lambda e: jnp.searchsorted(e, expert_range, side="left"))(sorted_experts)
  run_end = jax.vmap(lambda e: jnp.searchsorted(e, expert_range, side="right"))(sorted_experts)
  run_start = run_start.astype(jnp.int32)
  run_end = run_end.astype(jnp.int32)
  # assignment_of_slot: the c-th entry of expert e's run, when the run is long enough.
  position = jnp.arange(capacity, dtype=jnp.int32)
  source = run_start[..., None] + position  # (G, E, C)
  filled = source < run_end[..., None]
  gathered = jnp.take_along_axis(
      sorted_ids, jnp.minimum(source, num_assign - 1).reshape(num_groups, -1), axis=-1)
  assignment_of_slot = jnp.where(filled.reshape(num_groups, -1), gathered, num_assign)
  # slot_of_assignment: invert the sort (a permutation, so a scatter with unique indices).
  rank_sorted = jnp.arange(num_assign, dtype=jnp.int32) - jnp.take_along_axis(
      run_start, sorted_experts, axis=-1)
  slot_sorted = jnp.where(rank_sorted < capacity, sorted_experts * capacity + rank_sorted,
                          num_experts * capacity)
  slot_of_assignment = jax.vmap(
      lambda ids, slots: jnp.zeros_like(slots).at[ids].set(slots, unique_indices=True))(
          sorted_ids, slot_sorted)
  kept = (slot_of_assignment < num_experts * capacity).reshape(num_groups, num_tokens, k)
  combine_weights = jnp.where(kept, weights, 0.0)
  return routing.DispatchPlan(slot_of_assignment=slot_of_assignment,
                      assignment_of_slot=assignment_of_slot.astype(jnp.int32),
                      combine_weights=combine_weights, num_experts=num_experts,
                      capacity=capacity, k=k, experts=experts, gates=gates)


plan_dispatch_by_sort_jit = jax.jit(
    plan_dispatch_by_sort, static_argnames=("k", "capacity", "batch_priority", "priority"))


def top_k_reference(gate_row: np.ndarray, k: int) -> tuple[list[int], list[float]]:
  """TOP_k of one token's gate vector, largest first; equal gates: lower expert id first."""
  experts = sorted(range(len(gate_row)), key=lambda e: (-float(gate_row[e]), e))[:k]
  return experts, [float(gate_row[e]) for e in experts]


def route_reference(gates: np.ndarray, k: int, capacity: int, batch_priority: bool = False,
                    priority: str = "max") -> list[list[tuple[int, int, float]]]:
  """Algorithms 1 / 2 of the paper for ONE group. gates: (S, E).

  Returns the E buffers, each a list of (patch, choice i (0-based), weight w) in the order the
  patches were added.
  """
  num_patches, num_experts = gates.shape
  router = [top_k_reference(gates[p], k) for p in range(num_patches)]
  if batch_priority:
    # Algorithm 2: s(p) = max_e w_{e,p} (= TOP-1 weight) or the sum of the TOP-k weights.
    scores = []
    for p in range(num_patches):
      _, weights = router[p]
      scores.append(weights[0] if priority == "max" else float(np.float32(sum(
          np.float32(w) for w in weights))))
    # SortPatches(scores, decreasing=True); equal scores keep the natural patch order.
    patch_order = sorted(range(num_patches), key=lambda p: (-scores[p], p))
  else:
    patch_order = list(range(num_patches))
  buffers: list[list[tuple[int, int, float]]] = [[] for _ in range(num_experts)]
  for i in range(k):
    for p in patch_order:
      experts, weights = router[p]
      e, w = experts[i], weights[i]
      if len(buffers[e]) < capacity:  # e is not full
        buffers[e].append((p, i, w))  # add patch p to the buffer of expert e with weight w
      else:
        pass  # skip the i-th expert assignment for patch p
  return buffers


def buffers_to_plan_arrays(buffers, num_patches: int, k: int, capacity: int):
  """The paper's buffers in the DispatchPlan encoding (slot = expert * C + position in buffer).

  Returns slot_of_assignment (S*k,), assignment_of_slot (E*C,), combine_weights (S, k).
  """
  num_experts = len(buffers)
  slot_of_assignment = np.full(num_patches * k, num_experts * capacity, np.int64)
  assignment_of_slot = np.full(num_experts * capacity, num_patches * k, np.int64)
  combine_weights = np.zeros((num_patches, k), np.float64)
  for e, buffer in enumerate(buffers):
    assert len(buffer) <= capacity
    for position, (p, i, w) in enumerate(buffer):
      slot = e * capacity + position
      slot_of_assignment[p * k + i] = slot
      assignment_of_slot[slot] = p * k + i
      combine_weights[p, i] = w
  return slot_of_assignment, assignment_of_slot, combine_weights


def plan_buffers(plan, group: int) -> list[list[tuple[int, int]]]:
  """Decodes one group of a DispatchPlan into per-expert buffers of (patch, choice)."""
  a_of_slot = np.asarray(plan.assignment_of_slot[group])
  k = plan.k
  num_assign = np.asarray(plan.slot_of_assignment).shape[1]
  buffers = []
  for e in range(plan.num_experts):
    entries = []
    for c in range(plan.capacity):
      a = int(a_of_slot[e * plan.capacity + c])
      if a < num_assign:
        entries.append((a // k, a % k))
    buffers.append(entries)
  return buffers


def normal_sf(z: float) -> float:
  """P(Z >= z) for Z ~ N(0, 1)."""
  return 0.5 * math.erfc(z / math.sqrt(2.0))


def squared_cv_reference(values) -> float:
  """(std / mean)^2 with the population std, as in eqs. (2) and (6)."""
  values = [float(v) for v in values]
  mean = sum(values) / len(values)
  var = sum((v - mean) ** 2 for v in values) / len(values)
  return var / mean ** 2


def softmax_reference(row) -> list[float]:
  m = max(float(v) for v in row)
  ex = [math.exp(float(v) - m) for v in row]
  total = sum(ex)
  return [v / total for v in ex]


def importance_loss_reference(logits_clean: np.ndarray) -> np.ndarray:
  """Eqs. (1)-(2) per group. logits_clean: (G, S, E) = W x."""
  out = []
  for group in logits_clean:
    num_experts = group.shape[-1]
    imp = [0.0] * num_experts
    for x in group:
      gates = softmax_reference(x)
      for i in range(num_experts):
        imp[i] += gates[i]
    out.append(squared_cv_reference(imp))
  return np.array(out)


def load_loss_reference(logits_clean: np.ndarray, logits_noisy: np.ndarray, sigma: float,
                        k: int) -> np.ndarray:
  """Eqs. (3)-(6) per group: threshold = k-th largest noisy score, p_i = P(eps_new >= thr - Wx_i)."""
  out = []
  for clean_group, noisy_group in zip(logits_clean, logits_noisy):
    num_experts = clean_group.shape[-1]
    load = [0.0] * num_experts
    for clean, noisy in zip(clean_group, noisy_group):
      threshold = sorted((float(v) for v in noisy), reverse=True)[k - 1]
      for i in range(num_experts):
        load[i] += normal_sf((threshold - float(clean[i])) / sigma)
    out.append(squared_cv_reference(load))
  return np.array(out)
