"""dispatch / combine: "indices" vs "einsum" vs a NumPy loop over the plan, values and gradients."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.models.moe import dispatch as dispatch_lib
from moe_reference import plan_dispatch_jit

# (groups, tokens, experts, k, capacity, batch_priority): tight capacity (drops + full buffers),
# and generous capacity (empty, zero-padded slots).
PLAN_CONFIGS = {
    "tight_k2": (2, 6, 3, 2, 2, False),
    "loose_k1_bpr": (3, 5, 4, 1, 4, True),
    "tight_k3": (2, 7, 4, 3, 2, True),
}
D = 3

# Jitted once per module: one compilation per (plan shape, method) instead of one per primitive.
dispatch_jit = jax.jit(dispatch_lib.dispatch, static_argnames="method")
combine_jit = jax.jit(dispatch_lib.combine, static_argnames="method")


def _make(name, seed=0):
  g, s, e, k, c, bpr = PLAN_CONFIGS[name]
  rng = np.random.default_rng(seed)
  gates = rng.dirichlet(np.ones(e) * 0.6, size=(g, s)).astype(np.float32)
  plan = plan_dispatch_jit(jnp.asarray(gates), k=k, capacity=c, batch_priority=bpr,
                           priority="max")
  x = rng.normal(size=(g, s, D)).astype(np.float32)
  y = rng.normal(size=(e, g, c, D)).astype(np.float32)
  return plan, x, y


def _np_dispatch(x, plan):
  g, s, d = x.shape
  e, c, k = plan.num_experts, plan.capacity, plan.k
  a_of_slot = np.asarray(plan.assignment_of_slot)
  out = np.zeros((e, g, c, d), np.float64)
  for gi in range(g):
    for ei in range(e):
      for ci in range(c):
        a = a_of_slot[gi, ei * c + ci]
        if a < s * k:
          out[ei, gi, ci] = x[gi, a // k]
  return out


def _np_combine(y, plan, weights=None):
  e, g, c, d = y.shape
  w = np.asarray(plan.combine_weights if weights is None else weights)
  _, s, k = w.shape
  slot_of_a = np.asarray(plan.slot_of_assignment)
  out = np.zeros((g, s, d), np.float64)
  for gi in range(g):
    for t in range(s):
      for i in range(k):
        slot = slot_of_a[gi, t * k + i]
        if slot < e * c:
          out[gi, t] += w[gi, t, i] * y[slot // c, gi, slot % c]
  return out


def _np_grads(plan, x, y, r_dispatch, r_combine):
  """Gradients of L = <dispatch(x), R1> + <combine(y, w), R2> by hand, with loops."""
  g, s, d = x.shape
  e, c, k = plan.num_experts, plan.capacity, plan.k
  w = np.asarray(plan.combine_weights)
  slot_of_a = np.asarray(plan.slot_of_assignment)
  dx = np.zeros_like(x, np.float64)
  dy = np.zeros_like(y, np.float64)
  dw = np.zeros_like(w, np.float64)
  for gi in range(g):
    for t in range(s):
      for i in range(k):
        slot = slot_of_a[gi, t * k + i]
        if slot < e * c:
          ei, ci = slot // c, slot % c
          dx[gi, t] += r_dispatch[ei, gi, ci]
          dy[ei, gi, ci] += w[gi, t, i] * r_combine[gi, t]
          dw[gi, t, i] = y[ei, gi, ci] @ r_combine[gi, t]
  return dx, dy, dw


@pytest.mark.parametrize("name", sorted(PLAN_CONFIGS))
def test_forward_matches_numpy_loops(name):
  plan, x, y = _make(name)
  assert not bool(plan.kept.all()) or name.startswith("loose")
  want_buffers = _np_dispatch(x, plan)
  want_out = _np_combine(y, plan)
  for method in dispatch_lib.DISPATCHERS:
    buffers = dispatch_jit(jnp.asarray(x), plan, method=method)
    assert buffers.shape == want_buffers.shape
    np.testing.assert_allclose(np.asarray(buffers), want_buffers, rtol=1e-6, atol=1e-6,
                               err_msg=method)
    out = combine_jit(jnp.asarray(y), plan, method=method)
    assert out.shape == want_out.shape
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-6, err_msg=method)


@pytest.mark.parametrize("name", sorted(PLAN_CONFIGS))
def test_gradients_agree_between_methods_and_numpy(name):
  plan, x, y = _make(name, seed=1)
  rng = np.random.default_rng(100)
  r_dispatch = rng.normal(size=(plan.num_experts,) + y.shape[1:]).astype(np.float32)
  r_combine = rng.normal(size=x.shape).astype(np.float32)

  def loss(x, y, w, method):
    p = dataclasses.replace(plan, combine_weights=w)
    return (jnp.sum(dispatch_lib.dispatch(x, p, method) * r_dispatch) +
            jnp.sum(dispatch_lib.combine(y, p, method) * r_combine))

  want = _np_grads(plan, x, y, r_dispatch, r_combine)
  grads = {}
  for method in dispatch_lib.DISPATCHERS:
    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnames="method")
    grads[method] = grad_fn(jnp.asarray(x), jnp.asarray(y), plan.combine_weights, method=method)
    for got, ref, what in zip(grads[method], want, ("x", "expert outputs", "combine weights")):
      np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5,
                                 err_msg=f"{method}: d/d {what}")
  for a, b in zip(grads["indices"], grads["einsum"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_dropped_assignments_get_no_gradient_and_no_output():
  plan, x, y = _make("tight_k2", seed=2)
  kept = np.asarray(plan.kept)
  assert (~kept).any()
  # A token none of whose assignments was kept gets a zero output from combine and zero gradient.
  fully_dropped = ~kept.any(-1)
  out = np.asarray(combine_jit(jnp.asarray(y), plan, method="indices"))
  np.testing.assert_array_equal(out[fully_dropped], 0.0)
  dx = jax.jit(jax.grad(lambda x: dispatch_lib.dispatch(x, plan, "indices").sum()))(jnp.asarray(x))
  # Each token's gradient counts how many of its assignments were kept (one slot each).
  np.testing.assert_array_equal(np.asarray(dx), np.broadcast_to(
      kept.sum(-1)[..., None].astype(np.float32), x.shape))


def test_gather_rows_custom_vjp_matches_autodiff_of_a_gather():
  rng = np.random.default_rng(5)
  src = jnp.asarray(rng.normal(size=(5, 2)), jnp.float32)
  index = jnp.asarray([4, 0, 9, 0, 2, 4, 4], jnp.int32)  # 9: out of range, reads zeros
  # inverse[r] lists the outputs reading row r (7 = none), padded to width 3.
  inverse = jnp.asarray([[1, 3, 7], [7, 7, 7], [4, 7, 7], [7, 7, 7], [0, 5, 6]], jnp.int32)
  cot = jnp.asarray(rng.normal(size=(7, 2)), jnp.float32)
  out = dispatch_lib.gather_rows(src, index, inverse)
  np.testing.assert_array_equal(np.asarray(out[2]), [0.0, 0.0])
  np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(src[4]))
  got = jax.grad(lambda s: jnp.sum(dispatch_lib.gather_rows(s, index, inverse) * cot))(src)
  want = jax.grad(lambda s: jnp.sum(
      jnp.take(s, index, axis=0, mode="fill", fill_value=0) * cot))(src)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
