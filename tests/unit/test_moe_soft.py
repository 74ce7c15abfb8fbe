"""SoftRouter + SoftPlan (and MoeMlpBlock with a soft router) against a NumPy transcription of the
reference Soft MoE (vmoe/projects/soft_moe/router.py; Puigcerver et al. 2023, Algorithm 1):
L2-normalised tokens and slot parameters mu (eps 1e-6 inside the rsqrt), logits scaled by `scale`,
dispatch = softmax over the tokens, combine = softmax over all E * P slots, slots mix the
unnormalised tokens."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config import sections
from runner.config.schema import RouterConfig
from runner.models.moe import routers
from runner.models.moe.layer import MoeMlpBlock
from runner.models.moe.routers import soft as soft_lib
from runner.models.moe.routers.soft import SoftRouter, derived_slots
from router_reference import (compute_capacity, einsum_combine, einsum_dispatch, is_half_tie,
                              l2_normalize, mlp_experts, soft_weights)

G, S, D, E = 2, 12, 8, 4
SCALE = 2.5  # not the initial 1: the logits must use it


def _key(seed):
  return jax.random.key(seed, impl="rbg")  # compiles faster than threefry on CPU


def _expert_fn(params, buffers):
  """A simple per-expert function on (E, G, P, D) slots: f_e(z) = tanh(a_e * z + b_e)."""
  a, b = params
  return jnp.tanh(a[:, None, None, :] * buffers + b[:, None, None, :])


def _expert_fn_np(params, buffers):
  a, b = (np.asarray(p, np.float64) for p in params)
  return np.tanh(a[:, None, None, :] * buffers + b[:, None, None, :])


def _data(p, seed=0, x_shape=(G, S, D)):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=x_shape).reshape(-1, D).astype(np.float32)
  x[3] *= 1e-3  # |x|^2 ~ 1e-6: the eps inside the rsqrt matters
  x[-2] = 0.0   # a zero token: normalised to zero, logits 0
  mu = rng.normal(size=(D, E, p)).astype(np.float32)
  mu[:, 0, 0] *= 1e-3  # a tiny slot parameter: eps matters for mu as well
  params = {"mu": jnp.asarray(mu), "scale": jnp.asarray(SCALE, jnp.float32)}
  expert_params = (jnp.asarray(rng.normal(size=(E, D)), jnp.float32),
                   jnp.asarray(rng.normal(size=(E, D)), jnp.float32))
  return jnp.asarray(x.reshape(x_shape)), params, expert_params


_CACHE = {}


def _runner(**kwargs):
  """One jitted router + dispatch + f + combine per router configuration."""
  config = tuple(sorted(kwargs.items()))
  if config not in _CACHE:
    module = SoftRouter(num_experts=E, **kwargs)

    def run(params, x, key, expert_params, train):
      plan, metrics = module.apply({"params": params}, x, train=train, rngs={"gating": key})
      buffers = plan.dispatch(x, "einsum")
      out = plan.combine(_expert_fn(expert_params, buffers), "einsum")
      return plan, metrics, plan.expert_weights(), buffers, out

    _CACHE[config] = jax.jit(run, static_argnames="train")
  return _CACHE[config]


def _reference(x, params, expert_params, noise=None):
  logits, dispatch, combine = soft_weights(np.asarray(x), np.asarray(params["mu"]),
                                           float(params["scale"]), noise)
  buffers = einsum_dispatch(np.asarray(x, np.float64), dispatch)  # unnormalised tokens
  out = einsum_combine(_expert_fn_np(expert_params, buffers), combine)
  return logits, dispatch, combine, buffers, out


@pytest.mark.parametrize("p", [1, 3, 8])  # P = 8: x has fewer elements than mu (scale into x)
@pytest.mark.parametrize("train", [False, True])
def test_matches_reference_soft_moe(p, train):
  x, params, expert_params = _data(p)
  plan, metrics, weights, buffers, out = _runner(slots_per_expert=p, noise_std=0.0)(
      params, x, _key(0), expert_params, train=train)
  assert plan.num_experts == E and plan.capacity == p
  logits, dispatch, combine, want_buffers, want_out = _reference(x, params, expert_params)
  n = E * p
  np.testing.assert_allclose(np.asarray(plan.dispatch_weights), dispatch.reshape(G, S, n),
                             rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(plan.combine_weights), combine.reshape(G, S, n),
                             rtol=1e-5, atol=1e-7)
  assert buffers.shape == (E, G, p, D) and buffers.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(buffers), want_buffers, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
  # Convex combinations: every slot's dispatch weights sum to 1 over the tokens, every token's
  # combine weights to 1 over the slots.
  np.testing.assert_allclose(np.asarray(plan.dispatch_weights).sum(1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(plan.combine_weights).sum(2), 1.0, rtol=1e-5)
  # The softmaxes are not degenerate (the test would not see the normalisation otherwise).
  assert np.ptp(logits) > 1.0
  # expert_weights: each token's share of its dispatch mass per expert.
  per_expert = dispatch.sum(-1)
  np.testing.assert_allclose(np.asarray(weights), per_expert / per_expert.sum(-1, keepdims=True),
                             rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-5)
  assert plan.expert_mask(True) is None and plan.expert_mask(False) is None
  # Metrics.
  flat_c, flat_d = combine.reshape(G, S, n), dispatch.reshape(G, S, n)
  want_metrics = {"auxiliary_loss": 0.0, "fraction_dropped_tokens": 0.0,
                  "combine_weights_min_mean": flat_c.min(2).mean(),
                  "combine_weights_max_mean": flat_c.max(2).mean(),
                  "dispatch_weights_min_mean": flat_d.min(1).mean(),
                  "dispatch_weights_max_mean": flat_d.max(1).mean()}
  assert set(metrics) == set(want_metrics)
  for key, value in want_metrics.items():
    np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-5, atol=1e-8, err_msg=key)


def test_normalisation_uses_eps_inside_the_rsqrt():
  """The tiny token (|x|^2 ~ 1e-6) has a normalised norm of about 1/sqrt(2), not 1."""
  x, params, expert_params = _data(3)
  xn = l2_normalize(np.asarray(x), axis=-1)
  tiny = np.linalg.norm(xn.reshape(-1, D)[3])
  assert 0.5 < tiny < 0.9
  np.testing.assert_allclose(np.asarray(soft_lib.normalize(x, axis=-1)), xn, rtol=1e-5,
                             atol=1e-7)
  mu = np.asarray(params["mu"])
  np.testing.assert_allclose(np.asarray(soft_lib.normalize(params["mu"], axis=0)),
                             l2_normalize(mu, axis=0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("p", [1, 3])
def test_permuting_tokens_permutes_outputs(p):
  x, params, expert_params = _data(p, seed=1)
  perm = np.random.default_rng(4).permutation(S)
  run = _runner(slots_per_expert=p, noise_std=0.0)
  plan, _, _, buffers, out = run(params, x, _key(0), expert_params, train=False)
  plan_p, _, _, buffers_p, out_p = run(params, x[:, perm], _key(0), expert_params, train=False)
  np.testing.assert_allclose(np.asarray(out_p), np.asarray(out)[:, perm], rtol=1e-5, atol=1e-6)
  # The slots mix the same tokens: they do not move.
  np.testing.assert_allclose(np.asarray(buffers_p), np.asarray(buffers), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(plan_p.combine_weights),
                             np.asarray(plan.combine_weights)[:, perm], rtol=1e-5, atol=1e-7)


def test_noise_only_in_training_and_only_with_noise_std():
  p, sigma = 3, 0.5
  x, params, expert_params = _data(p, seed=2)
  clean_logits, _, clean_combine, _, clean_out = _reference(x, params, expert_params)
  noisy = _runner(slots_per_expert=p, noise_std=sigma)
  # Evaluation: no noise whatever the key.
  for seed in (0, 1):
    plan, _, _, _, out = noisy(params, x, _key(seed), expert_params, train=False)
    np.testing.assert_allclose(np.asarray(out), clean_out, rtol=1e-5, atol=1e-5)
  # noise_std 0 in training: no noise either.
  plan, _, _, _, out = _runner(slots_per_expert=p, noise_std=0.0)(params, x, _key(0),
                                                                  expert_params, train=True)
  np.testing.assert_allclose(np.asarray(out), clean_out, rtol=1e-5, atol=1e-5)
  # Training with noise: the logits move by N(0, sigma^2) (not sigma / E). log(combine) centred
  # per token is L + n - mean(L + n); minus the clean one it is n - mean(n), of variance
  # sigma^2 (1 - 1/N) over the N slots.
  n = E * p
  clean = clean_logits.reshape(G, S, n)
  clean = clean - clean.mean(-1, keepdims=True)
  residuals = []
  plans = []
  for seed in range(4):  # 4 draws x 24 tokens x 11 dof
    plan, metrics, _, _, out = noisy(params, x, _key(seed), expert_params, train=True)
    plans.append(plan)
    log_c = np.log(np.asarray(plan.combine_weights, np.float64))
    residuals.append((log_c - log_c.mean(-1, keepdims=True) - clean).reshape(-1))
    # Still convex combinations, nothing dropped, and the output moved.
    np.testing.assert_allclose(np.asarray(plan.dispatch_weights).sum(1), 1.0, rtol=1e-5)
    assert not np.allclose(np.asarray(out), clean_out, atol=1e-3)
    assert float(metrics["fraction_dropped_tokens"]) == 0.0
  residuals = np.concatenate(residuals)
  sigma_hat = np.sqrt(np.mean(residuals ** 2) / (1 - 1 / n))
  np.testing.assert_allclose(sigma_hat, sigma, rtol=0.1)
  assert not np.array_equal(np.asarray(plans[0].combine_weights),
                            np.asarray(plans[1].combine_weights))
  # Dispatch and combine are softmaxes of the SAME noisy logits L': log(dispatch) - log(combine)
  # = lse_slots(L')[t] - lse_tokens(L')[slot], a token term plus a slot term (no interaction).
  plan = plans[0]
  log_c = np.log(np.asarray(plan.combine_weights, np.float64))
  log_d = np.log(np.asarray(plan.dispatch_weights, np.float64))
  diff = log_d - log_c
  resid = (diff - diff.mean(1, keepdims=True) - diff.mean(2, keepdims=True)
           + diff.mean((1, 2), keepdims=True))
  np.testing.assert_allclose(resid, 0.0, atol=1e-4)


def test_derived_slots_and_family_capacity():
  checked_ties = 0
  for tokens in (1, 2, 5, 8, 10, 12, 16, 45, 64, 196, 197, 256):
    for experts in (1, 2, 3, 4, 8, 16, 128, 256):
      for ratio in (0.25, 0.5, 0.7, 1.0, 1.5, 2.0):
        got = derived_slots(tokens, experts, ratio)
        try:  # the reference's compute_capacity(round, multiple 1), exact halves to even
          want = compute_capacity(tokens, experts, ratio, "round", 1)
        except ValueError:  # rounds to 0: at least one slot (the reference raises)
          want = 1
        assert got == want, (tokens, experts, ratio)
        checked_ties += is_half_tie(tokens, experts, ratio)
  assert checked_ties > 5
  assert derived_slots(10, 4, 1.0) == 2   # 2.5: Python's round, to even
  assert derived_slots(14, 4, 1.0) == 4   # 3.5: to even
  assert derived_slots(196, 128, 1.0) == 2  # 1.53
  assert derived_slots(12, 128, 1.0) == 1  # 0.09: at least one
  family = routers.family("soft")
  assert family is soft_lib.Soft and family.module is SoftRouter
  router = sections.new(RouterConfig, type="soft", capacity_ratio=1.0)  # slots_per_expert, noise_std: None
  assert family.slots(router, 196, 8) == 24  # 24.5, to even
  assert family.capacity(router, 196, 8, train=True) == 24
  assert family.capacity(router, 196, 8, train=False) == 24
  assert family.module_kwargs(router, tokens=196, experts=8) == dict(
      slots_per_expert=24, noise_std=0.0)
  router = sections.new(RouterConfig, type="soft", capacity_ratio=2.0, slots_per_expert=1)  # the paper's P
  assert family.slots(router, 196, 8) == 1
  assert family.capacity(router, 196, 8, train=False) == 1
  router = sections.new(RouterConfig, type="soft", capacity_ratio=2.0, slots_per_expert=1, noise_std=0.3)
  assert family.module_kwargs(router, tokens=196, experts=8) == dict(
      slots_per_expert=1, noise_std=0.3)
  assert family.experts_per_token(router, 196, 8, 1) == 8.0


# ------------------------------------------------------------------------------------------------
# The whole layer: x (4 images, 6 tokens) in 2 groups of 2 images, real MLP experts.
# ------------------------------------------------------------------------------------------------

MLP = 16
_BLOCK_CACHE = {}


def _block_data(p, seed=3):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(4, 6, D)), jnp.float32)
  weights = tuple(jnp.asarray(0.3 * rng.normal(size=shape), jnp.float32)
                  for shape in ((E, D, MLP), (E, MLP), (E, MLP, D), (E, D)))
  params = {"router": {"mu": jnp.asarray(rng.normal(size=(D, E, p)), jnp.float32),
                       "scale": jnp.asarray(SCALE, jnp.float32)},
            "experts": dict(zip(("fc1_kernel", "fc1_bias", "fc2_kernel", "fc2_bias"), weights))}
  return x, params, weights


def _block(p, dtype):
  if (p, dtype) not in _BLOCK_CACHE:
    block = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, dtype=dtype,
                        router={"type": "soft", "slots_per_expert": p, "noise_std": 0.0})

    def run(params, x):
      return block.apply({"params": params}, x, train=False, mutable=["intermediates"])

    _BLOCK_CACHE[(p, dtype)] = (jax.jit(run), run)
  return _BLOCK_CACHE[(p, dtype)]


def _block_reference(x, params, weights):
  groups = np.asarray(x, np.float64).reshape(G, S, D)
  _, dispatch, combine = soft_weights(groups, np.asarray(params["router"]["mu"]), SCALE)
  slots = einsum_dispatch(groups, dispatch)
  return einsum_combine(mlp_experts(weights, slots), combine).reshape(x.shape)


@pytest.mark.parametrize("p", [1, 3])
def test_moe_block_with_soft_router_matches_numpy(p):
  x, params, weights = _block_data(p)
  (y, metrics), state = _block(p, jnp.float32)[0](params, x)
  want = _block_reference(x, params, weights)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
  assert np.abs(want).max() > 0.1
  assert float(metrics["fraction_dropped_tokens"]) == 0.0
  assert float(metrics["auxiliary_loss"]) == 0.0
  # No discrete choice: no expert masks are sown.
  assert "expert_mask" not in state.get("intermediates", {})
  assert "routed_mask" not in state.get("intermediates", {})


def _dot_operand_dtypes(jaxpr, shape) -> list:
  """dtypes of the operands of every dot_general (at any depth) with an operand of `shape`."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      avals = [v.aval for v in eqn.invars]
      if any(tuple(a.shape) == shape for a in avals):
        found.append(tuple(str(a.dtype) for a in avals))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found.extend(_dot_operand_dtypes(inner, shape))
  return found


def test_moe_block_bfloat16_mixes_in_bfloat16_and_stays_close():
  p = 3  # E * P = 12 slots: the (G, S, E * P) weights are the only (2, 12, 12) operands
  x, params, weights = _block_data(p, seed=5)
  want = _block_reference(x, params, weights)
  (y32, _), _ = _block(p, jnp.float32)[0](params, x)
  (y16, metrics), _ = _block(p, jnp.bfloat16)[0](params, x)
  assert y16.dtype == jnp.float32  # cast back to the input's dtype
  np.testing.assert_allclose(np.asarray(y16), want, rtol=0, atol=0.03 * np.abs(want).max())
  assert not np.array_equal(np.asarray(y16), np.asarray(y32))  # it did run in lower precision
  # The dispatch and combine einsums of the block: bfloat16 operands under dtype=bfloat16,
  # float32 otherwise.
  for dtype, want_dtype in ((jnp.bfloat16, "bfloat16"), (jnp.float32, "float32")):
    jaxpr = jax.make_jaxpr(_block(p, dtype)[1])(params, x).jaxpr
    found = _dot_operand_dtypes(jaxpr, (G, S, E * p))
    assert len(found) == 2, found
    assert all(d == (want_dtype, want_dtype) for d in found), found
  # The plan itself: bfloat16 buffers in, bfloat16 buffers out, logits and softmax in float32.
  router = SoftRouter(num_experts=E, slots_per_expert=p)
  groups = x.reshape(G, S, D)
  plan, _ = router.apply({"params": params["router"]}, groups, train=False)
  assert plan.dispatch_weights.dtype == jnp.float32
  buffers = plan.dispatch(groups.astype(jnp.bfloat16))
  assert buffers.dtype == jnp.bfloat16 and buffers.shape == (E, G, p, D)
  combined = plan.combine(buffers)
  assert combined.dtype == jnp.bfloat16 and combined.shape == (G, S, D)
  _, dispatch, combine = soft_weights(np.asarray(groups), np.asarray(params["router"]["mu"]),
                                      SCALE)
  want_buffers = einsum_dispatch(np.asarray(groups, np.float64), dispatch)
  np.testing.assert_allclose(np.asarray(buffers, np.float32), want_buffers, rtol=0,
                             atol=0.02 * np.abs(want_buffers).max())
  np.testing.assert_allclose(np.asarray(combined, np.float32),
                             einsum_combine(want_buffers, combine), rtol=0,
                             atol=0.03 * np.abs(want_buffers).max())
