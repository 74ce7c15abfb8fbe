"""Dispatch mechanics: move tokens into expert buffers and expert outputs back, given a plan.

A `DispatchPlan` says where each (token, choice) assignment goes; routing decides it, this module
only carries it out. Buffers are expert-major, (E, G, C, D): each expert's tokens from every group
are contiguous, and the experts run as one batched matmul with no transposes around it.

Two implementations of the same contract, chosen by name:
- "indices" (default): row gathers both ways, each backward the gather through the inverse index
  map the plan already holds: cost linear in tokens * k * hidden, independent of E * capacity.
- "einsum": the one-hot formulation of GShard and the reference V-MoE (time and memory grow with
  tokens x experts x capacity), kept as an independent reference for tests and benchmarks.
A `DroplessPlan` has no buffers: its rows, sorted by expert, go through the same row gathers."""
from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp

DISPATCHERS = ("indices", "einsum")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchPlan:
  """Where assignments go, for G groups of S tokens, k choices, E experts of capacity C.

  Assignment a = token * k + choice. Slot s = expert * C + position.
  slot_of_assignment[g, a] is the slot, or E * C when the assignment was dropped.
  assignment_of_slot[g, s] is the assignment, or S * k when the slot is empty (zero padded).
  combine_weights[g, t, i] is the gate of token t's i-th choice, 0 where it was dropped.
  experts[g, t, i] is token t's i-th choice (before capacity drops), gates[g, t, e] the routing
  weights; either may be None in plans built from the other arrays alone."""
  slot_of_assignment: jax.Array
  assignment_of_slot: jax.Array
  combine_weights: jax.Array
  num_experts: int = dataclasses.field(metadata=dict(static=True))
  capacity: int = dataclasses.field(metadata=dict(static=True))
  k: int = dataclasses.field(metadata=dict(static=True))
  experts: jax.Array | None = None
  gates: jax.Array | None = None

  def dispatch(self, x: jax.Array, method: str = "indices") -> jax.Array:
    """(G, S, D) tokens -> (E, G, C, D) expert buffers."""
    return dispatch(x, self, method)

  def combine(self, y: jax.Array, method: str = "indices") -> jax.Array:
    """(E, G, C, D) expert outputs -> (G, S, D) tokens."""
    return combine(y, self, method)

  def expert_weights(self) -> jax.Array:
    return self.gates

  def expert_mask(self, routed: bool = False) -> jax.Array:
    """(G, S, E): each token's TOP-k experts, or (`routed`) those that kept it in their buffer."""
    chosen = jax.nn.one_hot(self.experts, self.num_experts, dtype=jnp.bool_)  # (G, S, k, E)
    if routed:
      chosen = chosen & (self.combine_weights > 0)[..., None]
    return jnp.any(chosen, axis=-2)

  @property
  def kept(self) -> jax.Array:
    """(G, S, k) bool: which assignments found room in their expert's buffer."""
    g, s, k = self.combine_weights.shape
    return (self.slot_of_assignment < self.num_experts * self.capacity).reshape(g, s, k)

  @property
  def expert_of_slot_filled(self) -> jax.Array:
    """(G, E) number of filled slots of each expert: its kept assignments (a dropped one's slot
    E * C is no expert's)."""
    return count_ids(self.slot_of_assignment // self.capacity, self.num_experts)


def count_ids(ids: jax.Array, length: int) -> jax.Array:
  """(G, n) ids -> (G, length): how often each id in [0, length) occurs in each row; others are
  not counted. A one-hot sum: `jnp.bincount` would be a scatter-add of colliding indices."""
  return jnp.sum(jax.nn.one_hot(ids, length, dtype=jnp.int32), axis=-2)


def _take_rows(src: jax.Array, index: jax.Array) -> jax.Array:
  """src: (R, D), index: (M,) -> (M, D); out-of-range indices read zeros."""
  return jnp.take(src, index, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def gather_rows(src: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
  """out[m] = src[index[m]], zero where index is out of range. `inverse` (R, n) lists each source
  row's readers (out of range: none), so the gradient is a gather too, d_src[r] = sum_j
  d_out[inverse[r, j]], not the scatter-add that autodiff of a gather would produce."""
  del inverse
  return _take_rows(src, index)


def _gather_rows_fwd(src, index, inverse):
  return _take_rows(src, index), (index, inverse)


def _gather_rows_bwd(residuals, d_out):
  index, inverse = residuals
  r, n = inverse.shape
  d_src = _take_rows(d_out, inverse.reshape(r * n)).reshape(r, n, -1).sum(axis=1)
  return d_src, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _global_indices(plan: DispatchPlan, num_tokens: int):
  """The plan's per-group indices as rows of the flat arrays (out of range: none): token_of_slot
  (E*G*C,) into the G*S tokens, slot_of_assignment (G*S*k,) into the E*G*C slots, and
  assignment_of_slot (E*G*C,) into the G*S*k assignments."""
  g, s = plan.slot_of_assignment.shape[0], num_tokens
  e, c, k = plan.num_experts, plan.capacity, plan.k
  group = jnp.arange(g, dtype=jnp.int32)
  # Slots, local (G, E*C) -> expert-major global (E, G, C).
  a_of_slot = plan.assignment_of_slot
  a_valid = a_of_slot < s * k
  assignment_of_slot = jnp.where(a_valid, group[:, None] * (s * k) + a_of_slot, g * s * k)
  token_of_slot = jnp.where(a_valid, group[:, None] * s + a_of_slot // k, g * s)
  to_expert_major = lambda v: v.reshape(g, e, c).transpose(1, 0, 2).reshape(-1)
  # Assignments: local slot e*C + c -> global e*G*C + g*C + c.
  local = plan.slot_of_assignment
  s_valid = local < e * c
  slot_of_assignment = jnp.where(
      s_valid, (local // c) * (g * c) + group[:, None] * c + local % c, e * g * c)
  return (to_expert_major(token_of_slot), slot_of_assignment.reshape(-1),
          to_expert_major(assignment_of_slot))


def _check(method: str) -> None:
  if method not in DISPATCHERS:
    raise ValueError(f"unknown dispatcher {method!r}; valid: {DISPATCHERS}")


def dispatch(x: jax.Array, plan: DispatchPlan, method: str = "indices") -> jax.Array:
  """x: (G, S, D) tokens -> (E, G, C, D) expert buffers, zero padded."""
  _check(method)
  (g, s, d), e, c, k = x.shape, plan.num_experts, plan.capacity, plan.k
  if method == "einsum":
    return jnp.einsum("gsd,gsec->egcd", x, _dispatch_tensor(plan, s, x.dtype))
  token_of_slot, slot_of_assignment, _ = _global_indices(plan, s)
  buffers = gather_rows(x.reshape(g * s, d), token_of_slot, slot_of_assignment.reshape(g * s, k))
  return buffers.reshape(e, g, c, d)


def combine(y: jax.Array, plan: DispatchPlan, method: str = "indices") -> jax.Array:
  """y: (E, G, C, D) expert outputs -> (G, S, D) tokens: sum_i gate_i * y[slot of choice i]."""
  _check(method)
  e, g, c, d = y.shape
  _, s, k = plan.combine_weights.shape
  weights = plan.combine_weights.astype(y.dtype)
  if method == "einsum":
    return jnp.einsum("egcd,gsec->gsd", y, _dispatch_tensor(plan, s, y.dtype, weights))
  _, slot_of_assignment, assignment_of_slot = _global_indices(plan, s)
  picked = gather_rows(y.reshape(e * g * c, d), slot_of_assignment, assignment_of_slot[:, None])
  return jnp.einsum("gskd,gsk->gsd", picked.reshape(g, s, k, d), weights)


def _dispatch_tensor(plan: DispatchPlan, num_tokens: int, dtype, weights=None) -> jax.Array:
  """(G, S, E, C) one-hot (or gate-weighted) dispatch tensor of the einsum formulation."""
  g, e, c, k = plan.slot_of_assignment.shape[0], plan.num_experts, plan.capacity, plan.k
  onehot = jax.nn.one_hot(plan.slot_of_assignment.reshape(g, num_tokens, k), e * c, dtype=dtype)
  if weights is not None:
    onehot = onehot * weights[..., None]
  return onehot.sum(axis=2).reshape(g, num_tokens, e, c)


class RaggedLayout(typing.NamedTuple):
  """A dropless plan's M = G*S*k assignments as rows sorted by expert, as `jax.lax.ragged_dot`
  reads them: row r holds assignment order[r] (a = (group * S + token) * k + choice), one
  expert's rows contiguous in assignment order, group_sizes[e] of expert e, experts ascending;
  inverse[a] is the row of assignment a, experts[r] the expert of row r."""
  order: jax.Array  # (M,) int32
  inverse: jax.Array  # (M,) int32
  experts: jax.Array  # (M,) int32, ascending
  group_sizes: jax.Array  # (E,) int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DroplessPlan:
  """Dropless token choice: every (token, choice) assignment is processed, none dropped.

  experts[g, t, i] is token t's i-th choice, combine_weights[g, t, i] its TOP-k weight, gates[g,
  t, e] the routing weights. No buffers, no `dispatch` or `combine`: the MoE layer runs the
  experts on the `layout`'s rows with a grouped matmul and combines them back (`combine_rows`).
  `capacity` is S, a group's tokens: an expert takes each token at most once, so nothing
  overflows S slots (what `expert_load` divides by, and an exported router uses to drop nothing)."""
  experts: jax.Array
  combine_weights: jax.Array
  num_experts: int = dataclasses.field(metadata=dict(static=True))
  k: int = dataclasses.field(metadata=dict(static=True))
  gates: jax.Array | None = None

  ragged: typing.ClassVar[bool] = True  # the MoE layer runs it as sorted rows, not buffers

  @property
  def capacity(self) -> int:
    return self.combine_weights.shape[1]

  def expert_weights(self) -> jax.Array:
    return self.gates

  def expert_mask(self, routed: bool = False) -> jax.Array:
    """(G, S, E): each token's TOP-k experts, which all process it (`routed` changes nothing)."""
    del routed
    return jnp.any(jax.nn.one_hot(self.experts, self.num_experts, dtype=jnp.bool_), axis=-2)

  @property
  def kept(self) -> jax.Array:
    """(G, S, k) bool: every assignment."""
    return jnp.ones(self.combine_weights.shape, jnp.bool_)

  @property
  def expert_of_slot_filled(self) -> jax.Array:
    """(G, E) the assignments each expert processes in each group."""
    g = self.experts.shape[0]
    return count_ids(self.experts.reshape(g, -1).astype(jnp.int32), self.num_experts)

  def layout(self) -> RaggedLayout:
    """This device's assignments sorted by expert (one stable argsort of G*S*k expert ids: one
    key, as a GPU's fast sort takes it), so that every expert's rows from every group are
    contiguous, in assignment order, for one grouped matmul."""
    flat = self.experts.reshape(-1).astype(jnp.int32)
    ids = jnp.arange(flat.shape[0], dtype=jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    experts = flat[order]
    inverse = jnp.zeros_like(order).at[order].set(ids, unique_indices=True)
    group_sizes = count_ids(flat[None], self.num_experts)[0]
    return RaggedLayout(order=order, inverse=inverse, experts=experts, group_sizes=group_sizes)

  def rows(self, x: jax.Array, layout: RaggedLayout) -> jax.Array:
    """(G, S, D) tokens -> (G*S*k, D): row r is the token of assignment layout.order[r]."""
    g, s, d = x.shape
    return gather_rows(x.reshape(g * s, d), layout.order // self.k,
                       layout.inverse.reshape(g * s, self.k))

  def combine_rows(self, y: jax.Array, layout: RaggedLayout) -> jax.Array:
    """(G*S*k, D) expert outputs in the rows' order -> (G, S, D): sum_i gate_i * y[row of i]."""
    g, s, k = self.combine_weights.shape
    picked = gather_rows(y, layout.inverse, layout.order[:, None])
    return jnp.einsum("gskd,gsk->gsd", picked.reshape(g, s, k, -1),
                      self.combine_weights.astype(y.dtype))
