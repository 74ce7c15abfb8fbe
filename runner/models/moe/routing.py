"""Routing policy of V-MoE: which expert buffer slot each (token, choice) assignment gets
(V-MoE §2.3-2.4, Algorithms 1 and 2; docs/routers.md).

The result is a `DispatchPlan`, a partial bijection between assignments and buffer slots, or for
dropless routing a `DroplessPlan` that keeps every assignment; dispatch.py moves the tokens."""
from __future__ import annotations

import fractions
import math

import jax
import jax.numpy as jnp

from runner.models.moe.dispatch import DispatchPlan, DroplessPlan

PRIORITIES = ("max", "sum")
CAPACITY_ROUNDINGS = ("paper", "reference")
CAPACITY_MULTIPLE = 4  # the reference's `capacity_multiple_of` default
GATES = ("softmax", "sigmoid")


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_ratio: float,
                    rounding: str = "paper") -> int:
  """Buffer slots per expert for a group of `num_tokens` tokens, each sent to k of E experts.

  "paper": B_e = round(k * N * C / E) (V-MoE §2.4), rounding half up, and at least one slot;
  computed exactly from the decimal C (0.7 * 45 / 3 is 10.5, not 10.4999...).
  "reference": google-research/vmoe's (vmoe/moe.py `compute_capacity` with its defaults
  `ceil_or_round="ceil"`, `multiple_of=4`, num_tokens = group size * k): the ceil of
  ((N * k) * C) / E in floating point in that order, so 400 * 1.05 = 420.00000000000006 rounds up
  as there, then the next multiple of 4 (at least 4)."""
  rounding = str(rounding)
  if rounding == "reference":
    capacity = max(1, math.ceil(num_tokens * k * float(capacity_ratio) / num_experts))
    return capacity + (-capacity) % CAPACITY_MULTIPLE
  if rounding != "paper":
    raise ValueError(f"unknown capacity rounding {rounding!r}; valid: {CAPACITY_ROUNDINGS}")
  exact = fractions.Fraction(str(capacity_ratio)) * k * num_tokens / num_experts
  return max(1, math.floor(exact + fractions.Fraction(1, 2)))


def ratio_in_force(router, train: bool) -> float:
  """The capacity ratio of a model.router config (or router module): eval_capacity_ratio at
  inference when it is set, else capacity_ratio."""
  if not train and router.eval_capacity_ratio is not None:
    return router.eval_capacity_ratio
  return router.capacity_ratio


def _pick(values: jax.Array, index: jax.Array) -> jax.Array:
  """values[..., index] as a one-hot product: its gradient is dense, not a (slow) scatter."""
  onehot = jax.nn.one_hot(index, values.shape[-1], dtype=values.dtype)
  return jnp.sum(onehot * values[..., None, :], axis=-1)  # fuses; an einsum here would not


def top_k_indices(values: jax.Array, k: int) -> jax.Array:
  """Indices of the k largest values along the last axis, largest first, ties to the lower index.
  k rounds of argmax: for routing's small k cheaper than `lax.top_k`, which XLA's CPU backend
  turns into a full sort of every row when its result feeds a broadcast."""
  values = jax.lax.stop_gradient(values)
  picked = []
  for _ in range(k):
    index = jnp.argmax(values, axis=-1)
    picked.append(index)
    values = jnp.where(jax.nn.one_hot(index, values.shape[-1], dtype=bool), -jnp.inf, values)
  return jnp.stack(picked, axis=-1).astype(jnp.int32)


def top_k_gates(gates: jax.Array, k: int,
                select: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(weights, experts) of the k largest gates, largest first; ties go to the lower expert id.
  With `select` (shaped like `gates`), the k largest of `select` instead, their weights still
  read from `gates` (auxiliary-loss-free balancing's biased choice, `biased_gates`)."""
  experts = top_k_indices(gates if select is None else select, k)
  return _pick(gates, experts), experts


def plan_dispatch(gates: jax.Array, *, k: int, capacity: int, batch_priority: bool = False,
                  priority: str = "max", select: jax.Array | None = None) -> DispatchPlan:
  """Assigns each token's TOP-k experts to buffer slots, dropping what does not fit.

  gates: (G, S, E) routing weights (softmax, or `sigmoid_gates`); `select` (G, S, E), when given,
  chooses the TOP-k instead, the gates staying the combine weights (`biased_gates`). Assignments
  claim slots in priority order: every first choice before any second choice, and within a choice
  token order, or with Batch Prioritized Routing the order of decreasing score (one stable argsort
  of a score per token). An assignment's position in its expert's buffer is the number of earlier
  assignments to that expert: a cumulative sum of one-hot choices in that order, as the reference
  code computes it, with no sort and no loop (XLA runs it as a few fused kernels on any backend);
  memory (G, S*k, E) integers, linear in the tokens."""
  if priority not in PRIORITIES:
    raise ValueError(f"unknown routing priority {priority!r}; valid: {PRIORITIES}")
  num_groups, num_tokens, num_experts = gates.shape
  weights, experts = top_k_gates(gates, k, select)  # (G, S, k)
  order, experts_ranked = None, experts
  if batch_priority:  # token order[g, r] has rank r: decreasing score, ties in token order
    score = weights[..., 0] if priority == "max" else weights.sum(-1)
    # Gates are >= 0, and the bits of a non-negative float order as the float does: an integer
    # key, which a stable sort takes with its indices alone (a float key adds a third operand).
    bits = jax.lax.bitcast_convert_type(score + 0.0, jnp.int32)  # + 0.0: no -0.0
    order = jnp.argsort(-bits, axis=-1, stable=True).astype(jnp.int32)
    experts_ranked = jnp.take_along_axis(experts, order[..., None], axis=1)
  # (G, k*S, E): the one-hot choices in priority order, choice-major.
  chosen = jax.nn.one_hot(experts_ranked.transpose(0, 2, 1).reshape(num_groups, -1), num_experts,
                          dtype=jnp.int32)
  earlier = jnp.cumsum(chosen, axis=1) - chosen
  position = jnp.sum(earlier * chosen, axis=-1).reshape(num_groups, k, num_tokens)
  position = position.transpose(0, 2, 1)  # (G, S, k): per token (in rank order) and choice
  if order is not None:  # back to token order: a permutation, a scatter of unique indices
    position = jax.vmap(lambda p, o: jnp.zeros_like(p).at[o].set(p, unique_indices=True))(
        position, order)
  num_assign, num_slots = num_tokens * k, num_experts * capacity
  kept = position < capacity
  slot_of_assignment = jnp.where(kept, experts * capacity + position, num_slots).reshape(
      num_groups, num_assign).astype(jnp.int32)
  # assignment_of_slot: invert the partial bijection. Each dropped assignment writes to its own
  # out-of-range slot (dropped by the scatter), so the written indices are all distinct.
  assignment_ids = jnp.arange(num_assign, dtype=jnp.int32)
  targets = jnp.where(kept.reshape(num_groups, num_assign), slot_of_assignment,
                      num_slots + assignment_ids)
  assignment_of_slot = jax.vmap(lambda t: jnp.full((num_slots,), num_assign, jnp.int32).at[t].set(
      assignment_ids, mode="drop", unique_indices=True))(targets)
  combine_weights = jnp.where(kept, weights, 0.0)
  return DispatchPlan(slot_of_assignment=slot_of_assignment,
                      assignment_of_slot=assignment_of_slot,
                      combine_weights=combine_weights, num_experts=num_experts,
                      capacity=capacity, k=k, experts=experts, gates=gates)


def plan_dropless(gates: jax.Array, *, k: int, select: jax.Array | None = None) -> DroplessPlan:
  """Each token's TOP-k experts, every assignment kept with its TOP-k weight (as `plan_dispatch`
  weighs those it keeps); gates and `select` (G, S, E) as for `plan_dispatch`."""
  weights, experts = top_k_gates(gates, k, select)
  return DroplessPlan(experts=experts, combine_weights=weights, num_experts=gates.shape[-1], k=k,
                      gates=gates)


def squared_cv(values: jax.Array) -> jax.Array:
  """(std / mean)^2 over the last axis, written as var / mean^2 (finite gradient at zero std)."""
  return jnp.var(values, axis=-1) / jnp.mean(values, axis=-1) ** 2


def importance_loss(gates_clean: jax.Array) -> jax.Array:
  """Appendix A.2, eqs. 1-2: squared CV of the summed softmax(Wx) per expert, for each group."""
  return squared_cv(gates_clean.sum(axis=-2))


def load_loss(logits_clean: jax.Array, logits_noisy: jax.Array, noise_std: float,
              k: int) -> jax.Array:
  """Appendix A.2, eqs. 3-6: squared CV of the expected expert load under re-sampled noise:
  load_i = sum over tokens of p_i(x) (`entry_probability`)."""
  return squared_cv(entry_probability(logits_clean, logits_noisy, noise_std, k).sum(axis=-2))


def entry_probability(logits_clean: jax.Array, logits_noisy: jax.Array, noise_std: float,
                      k: int) -> jax.Array:
  """p_i(x) of the load loss (eqs. 4-5), the probability that expert i enters the token's TOP-k
  when the noise is drawn again: P(eps_new >= threshold - (Wx)_i), eps_new ~ N(0, noise_std^2),
  threshold the k-th largest noisy logit. It depends on the logits' order only, so it is the same
  for any increasing gate (softmax, sigmoid)."""
  threshold = _pick(logits_noisy, top_k_indices(logits_noisy, k)[..., -1:])
  return 1.0 - jax.scipy.stats.norm.cdf((threshold - logits_clean) / noise_std)


def gate_weights(logits: jax.Array, gate: str, k: int) -> jax.Array:
  """The routing weights `plan_dispatch` reads: softmax(logits), or `sigmoid_gates`."""
  if gate == "softmax":
    return jax.nn.softmax(logits)
  if gate == "sigmoid":
    return sigmoid_gates(logits, k)
  raise ValueError(f"unknown gate {gate!r}; valid: {GATES}")


def importance_weights(logits: jax.Array, gates: jax.Array, gate: str) -> jax.Array:
  """What the importance loss sums per expert: the softmax gates, or for sigmoid the scores
  normalized over all E experts (DeepSeek-V3's s'_i, eq. 19), since `sigmoid_gates`' TOP-k
  normalization leaves the other experts' scale arbitrary (the load loss reads the order only)."""
  if gate == "softmax":
    return gates
  scores = jax.nn.sigmoid(logits)
  return scores / scores.sum(axis=-1, keepdims=True)


def sigmoid_gates(logits: jax.Array, k: int) -> jax.Array:
  """DeepSeek-V3's gates (arXiv 2412.19437, eqs. 15-16): scores s = sigmoid(logits), each token's
  TOP-k chosen on s, weights g_i = s_i / sum_{j in TOP-k} s_j. Returned as the whole row s /
  sum_{TOP-k} s (G, S, E), which keeps the order: `plan_dispatch` picks the same TOP-k and reads
  the normalized weights as combine weights (and Batch Prioritized Routing's priority)."""
  scores = jax.nn.sigmoid(logits)
  return scores / _pick(scores, top_k_indices(scores, k)).sum(axis=-1, keepdims=True)


def biased_gates(logits: jax.Array, gate: str, k: int,
                 bias: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Auxiliary-loss-free balancing (Wang et al. 2024, arXiv 2408.15664; DeepSeek-V3, eq. 16):
  (gates, select) for `plan_dispatch`. The scores s (softmax or sigmoid) plus the per-expert
  `bias` choose each token's TOP-k (`select`); the bias never weighs: the gates are the unbiased
  scores, for sigmoid s / sum_{j in TOP-k of s + b} s_j. No gradient reaches the bias."""
  if gate not in GATES:
    raise ValueError(f"unknown gate {gate!r}; valid: {GATES}")
  scores = jax.nn.softmax(logits) if gate == "softmax" else jax.nn.sigmoid(logits)
  select = jax.lax.stop_gradient(scores + jax.lax.stop_gradient(bias))
  if gate == "softmax":
    return scores, select
  return scores / _pick(scores, top_k_indices(select, k)).sum(axis=-1, keepdims=True), select
