"""NoisyTopKRouter: g(x) = TOP_k(softmax(Wx + eps)), eps ~ N(0, (noise_std / E)^2) in training."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.models.moe import routing
from runner.models.moe.routers import token_choice as router_lib
from runner.models.moe.routers.token_choice import NoisyTopKRouter
from moe_reference import (buffers_to_plan_arrays, importance_loss_reference,
                           load_loss_reference, route_reference)

G, S, D = 2, 16, 6
METRIC_KEYS_EVAL = {"importance_loss", "auxiliary_loss", "fraction_dropped_tokens",
                    "fraction_dropped_assignments", "expert_load", "max_violation",
                    "dead_experts", "saturated_experts"}


def _setup(seed=0, scale=1.0, **router_kwargs):
  module = NoisyTopKRouter(**router_kwargs)
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(G, S, D)), jnp.float32)
  # The module's own initializer is N(0, 0.02^2); built directly (module.init would trace the
  # whole router eagerly, which costs seconds).
  kernel = jnp.asarray(0.02 * scale * rng.normal(size=(D, module.num_experts)), jnp.float32)
  variables = {"params": {"dense": {"kernel": kernel}}}
  # One jitted apply per router configuration, shared between tests (fewer compilations).
  config = tuple(sorted(router_kwargs.items()))
  if config not in _APPLY_CACHE:
    _APPLY_CACHE[config] = jax.jit(
        lambda v, x, key, train: module.apply(v, x, train=train, rngs={"gating": key}),
        static_argnames="train")
  return module, variables, x, _APPLY_CACHE[config]


_APPLY_CACHE = {}


def _key(seed):
  # Gating keys for the jitted router. "rbg" keys compile much faster than the default threefry
  # on CPU; the spy test below uses a default key.
  return jax.random.key(seed, impl="rbg")


def _plans_equal(a, b):
  return (np.array_equal(a.slot_of_assignment, b.slot_of_assignment) and
          np.array_equal(a.assignment_of_slot, b.assignment_of_slot) and
          np.array_equal(a.combine_weights, b.combine_weights))


def test_eval_is_deterministic_and_routes_clean_gates():
  module, variables, x, apply = _setup(num_experts=4, k=2, capacity_ratio=0.75,
                                       batch_priority=True, scale=50.0)
  plan_a, metrics = apply(variables, x, _key(1), train=False)
  plan_b, _ = apply(variables, x, _key(2), train=False)
  assert _plans_equal(plan_a, plan_b)
  assert set(metrics) == METRIC_KEYS_EVAL  # no load loss without noise
  # Without noise the router is exactly Algorithm 2 on softmax(Wx).
  gates = np.asarray(jax.nn.softmax(x @ variables["params"]["dense"]["kernel"]), np.float32)
  capacity = routing.expert_capacity(S, 4, 2, 0.75)
  assert plan_a.capacity == capacity == 6
  for g in range(G):
    want = buffers_to_plan_arrays(route_reference(gates[g], 2, capacity, True, "max"), S, 2,
                                  capacity)
    np.testing.assert_array_equal(np.asarray(plan_a.slot_of_assignment[g]), want[0])
    np.testing.assert_allclose(np.asarray(plan_a.combine_weights[g]), want[2], rtol=1e-5)
  assert float(metrics["auxiliary_loss"]) == 0.5 * float(metrics["importance_loss"])


def test_train_noise_depends_on_the_gating_rng():
  module, variables, x, apply = _setup(num_experts=4, k=2, capacity_ratio=1.0)
  plan_a, _ = apply(variables, x, _key(1), train=True)
  plan_a2, _ = apply(variables, x, _key(1), train=True)
  plan_b, _ = apply(variables, x, _key(2), train=True)
  plan_eval, _ = apply(variables, x, _key(1), train=False)
  assert _plans_equal(plan_a, plan_a2)           # same key: reproducible
  assert not _plans_equal(plan_a, plan_b)        # other key: other noise
  assert not _plans_equal(plan_a, plan_eval)     # training adds noise at all
  # With the small initial router weights, the noise (std 1/E) flips many routing decisions.
  top1 = lambda p: np.asarray(p.slot_of_assignment).reshape(G, S, 2)[..., 0] // p.capacity
  assert (top1(plan_a) != top1(plan_b)).mean() > 0.1


@pytest.mark.parametrize("num_experts,noise_std", [(4, 1.0), (8, 3.0)])
def test_noise_std_is_noise_std_over_num_experts(num_experts, noise_std):
  """Black box: with W = 0 the noisy logits are pure noise. With k = E and C = E / k, every
  assignment is kept, so combine_weights holds the whole softmax(eps) of each token and
  log(weights) centred per token is eps - mean(eps), of variance sigma^2 (1 - 1/E)."""
  e = num_experts
  module, variables, x, apply = _setup(num_experts=e, k=e, capacity_ratio=e / e,
                                       noise_std=noise_std)
  variables = {"params": {"dense": {"kernel": jnp.zeros((D, e))}}}
  stds = []
  for seed in range(4):  # 4 draws of G * S tokens -> 128 tokens, 128 * (E - 1) dof
    plan, _ = apply(variables, x, _key(seed), train=True)
    assert bool(plan.kept.all())
    log_w = np.log(np.asarray(plan.combine_weights, np.float64))
    centred = log_w - log_w.mean(-1, keepdims=True)
    stds.append(centred.reshape(-1))
  centred = np.concatenate(stds)
  sigma_hat = np.sqrt(np.mean(centred ** 2) / (1 - 1 / e))
  # Relative standard error ~ 1/sqrt(2 * 384) < 4%; 15% is > 4 standard errors (and the keys
  # are fixed, so the test is deterministic anyway).
  np.testing.assert_allclose(sigma_hat, noise_std / e, rtol=0.15)


def test_train_routes_noisy_gates_and_load_loss_uses_them(monkeypatch):
  """White box: spy on routing.load_loss to get the noisy logits the router drew, then check the
  plan, the noise scale passed as sigma, and the metrics against the paper's definitions."""
  e, k, ratio, noise_std = 4, 2, 1.0, 2.0
  seen = {}

  def spy(logits_clean, logits_noisy, sigma, kk):
    seen.update(clean=logits_clean, noisy=logits_noisy, sigma=sigma, k=kk)
    return original(logits_clean, logits_noisy, sigma, kk)

  original = routing.load_loss
  monkeypatch.setattr(router_lib.routing, "load_loss", spy)
  module = NoisyTopKRouter(num_experts=e, k=k, capacity_ratio=ratio, noise_std=noise_std)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(G, S, D)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(D, e)) * 0.3, jnp.float32)
  variables = {"params": {"dense": {"kernel": kernel}}}

  @jax.jit
  def run(variables, x, key):
    plan, metrics = module.apply(variables, x, train=True, rngs={"gating": key})
    # The spy saw tracers of this same trace: return them as outputs.
    return plan, metrics, seen["clean"], seen["noisy"]

  plan, metrics, seen_clean, seen_noisy = run(variables, x, jax.random.key(3))
  seen.update(clean=np.asarray(seen_clean, np.float64), noisy=np.asarray(seen_noisy, np.float64))

  assert seen["sigma"] == pytest.approx(noise_std / e) and seen["k"] == k
  clean = np.asarray(x @ kernel, np.float64)
  np.testing.assert_allclose(seen["clean"], clean, rtol=1e-5, atol=1e-6)
  noise = seen["noisy"] - seen["clean"]
  # 128 samples: standard errors ~0.09 sigma (mean) and ~6% (std); bounds at >= 4 of them.
  assert abs(noise.mean()) < 0.4 * noise_std / e
  np.testing.assert_allclose(noise.std(), noise_std / e, rtol=0.3)
  # The plan is Algorithm 1 on softmax(Wx + eps) (the noisy gates), not on the clean ones.
  noisy_gates = np.asarray(jax.nn.softmax(jnp.asarray(seen["noisy"])), np.float32)
  capacity = routing.expert_capacity(S, e, k, ratio)
  assert plan.capacity == capacity
  for g in range(G):
    want = buffers_to_plan_arrays(route_reference(noisy_gates[g], k, capacity), S, k, capacity)
    np.testing.assert_array_equal(np.asarray(plan.slot_of_assignment[g]), want[0])
    np.testing.assert_allclose(np.asarray(plan.combine_weights[g]), want[2], rtol=1e-5)
  # Metrics: importance on the clean gates (eq. 1), load on the noisy threshold (eq. 3-6),
  # aux = mean of both (eq. 7), each averaged over groups.
  assert set(metrics) == METRIC_KEYS_EVAL | {"load_loss"}
  np.testing.assert_allclose(float(metrics["importance_loss"]),
                             importance_loss_reference(clean).mean(), rtol=1e-4)
  np.testing.assert_allclose(float(metrics["load_loss"]), load_loss_reference(
      seen["clean"], seen["noisy"], noise_std / e, k).mean(), rtol=1e-3)
  np.testing.assert_allclose(float(metrics["auxiliary_loss"]),
                             0.5 * float(metrics["importance_loss"]) +
                             0.5 * float(metrics["load_loss"]), rtol=1e-6)


@pytest.mark.parametrize("batch_priority", [False, True])
def test_reference_capacity_rounding_drops_what_the_formula_implies(batch_priority):
  # S=16 tokens, E=4, k=2, C=0.3: k*S*C/E = 2.4 -> paper round: 2 slots; reference: ceil 3,
  # then the next multiple of 4: 4 slots.
  kwargs = dict(num_experts=4, k=2, capacity_ratio=0.3, batch_priority=batch_priority, scale=50.0)
  _, variables, x, apply = _setup(capacity_rounding="reference", **kwargs)
  _, _, _, apply_paper = _setup(**kwargs)
  gates = np.asarray(jax.nn.softmax(x @ variables["params"]["dense"]["kernel"]), np.float32)
  kept = {}
  for rounding, run, capacity in (("reference", apply, 4), ("paper", apply_paper, 2)):
    plan, metrics = run(variables, x, _key(0), train=False)
    assert plan.capacity == capacity == routing.expert_capacity(S, 4, 2, 0.3, rounding)
    want_kept = np.zeros((G, S, 2), bool)
    for g in range(G):
      buffers = route_reference(gates[g], 2, capacity, batch_priority, "max")
      want = buffers_to_plan_arrays(buffers, S, 2, capacity)
      np.testing.assert_array_equal(np.asarray(plan.slot_of_assignment[g]), want[0])
      for buffer in buffers:
        for p, i, _ in buffer:
          want_kept[g, p, i] = True
    np.testing.assert_array_equal(np.asarray(plan.kept), want_kept)
    np.testing.assert_allclose(float(metrics["fraction_dropped_assignments"]),
                               1 - want_kept.mean(), rtol=1e-6)
    kept[rounding] = want_kept
  # 4 experts x 4 slots hold at most 16 of the 32 assignments, 4 x 2 at most 8.
  assert kept["paper"].sum() <= 2 * 4 * G < kept["reference"].sum() <= 4 * 4 * G


def vmoe_auxiliary_loss(importance_loss, load_loss=None, importance_loss_weight=0.005,
                        load_loss_weight=0.005):
  """vmoe/nn/routing.py NoisyTopExpertsPerItemRouter's metric with the paper configs' weights
  (vmoe/configs/vmoe_paper/common.py: 0.005 each, gshard 0): the load term only with noise."""
  total = importance_loss_weight * importance_loss
  if load_loss is not None:
    total += load_loss_weight * load_loss
  return total


@pytest.mark.parametrize("noise_std,train", [(0.0, True), (1.0, False), (1.0, True)])
def test_auxiliary_loss_weights_match_the_reference(noise_std, train):
  """lambda * auxiliary_loss (lambda = train.aux_loss_weight = 0.01) is the reference's
  auxiliary loss: importance keeps its weight 1/2 without noise (noise_std 0, or evaluation)."""
  _, variables, x, apply = _setup(num_experts=4, k=2, capacity_ratio=1.0, noise_std=noise_std,
                                  scale=30.0)
  _, metrics = apply(variables, x, _key(0), train=train)
  noisy = train and noise_std > 0
  assert ("load_loss" in metrics) == noisy
  logits = np.asarray(x @ variables["params"]["dense"]["kernel"], np.float64)
  importance = importance_loss_reference(logits).mean()
  np.testing.assert_allclose(float(metrics["importance_loss"]), importance, rtol=1e-4)
  want = vmoe_auxiliary_loss(float(metrics["importance_loss"]),
                             float(metrics["load_loss"]) if noisy else None)
  np.testing.assert_allclose(0.01 * float(metrics["auxiliary_loss"]), want, rtol=1e-6)
  assert float(metrics["importance_loss"]) > 1e-3  # not a comparison of zeros


def test_eval_capacity_ratio_only_applies_in_eval():
  # S=16 tokens, E=4, k=2: C=1.0 -> 8 slots, C=0.5 -> 4 slots.
  _, variables, x, apply = _setup(num_experts=4, k=2, capacity_ratio=1.0, eval_capacity_ratio=0.5)
  plan_train, _ = apply(variables, x, _key(0), train=True)
  plan_eval, metrics = apply(variables, x, _key(0), train=False)
  assert plan_train.capacity == routing.expert_capacity(S, 4, 2, 1.0) == 8
  assert plan_eval.capacity == 4
  assert plan_eval.assignment_of_slot.shape == (G, 4 * 4)
  kept = np.asarray(plan_eval.kept)
  np.testing.assert_allclose(float(metrics["expert_load"].sum()) * 4, kept.sum() / G, rtol=1e-6)
  # Without eval_capacity_ratio, evaluation uses capacity_ratio too.
  _, _, _, apply_default = _setup(num_experts=4, k=2, capacity_ratio=1.0)
  plan_default, _ = apply_default(variables, x, _key(0), train=False)
  assert plan_default.capacity == 8


@pytest.mark.parametrize("train", [False, True])
def test_metrics_present_finite_and_consistent_with_plan(train):
  e, k = 4, 2
  # Same router as in test_eval_capacity_ratio_only_applies_in_eval: 8 slots per expert in
  # training, 4 in evaluation.
  module, variables, x, apply = _setup(num_experts=e, k=k, capacity_ratio=1.0,
                                       eval_capacity_ratio=0.5, scale=30.0)
  plan, metrics = apply(variables, x, _key(0), train=train)
  want_keys = METRIC_KEYS_EVAL | ({"load_loss"} if train else set())
  assert set(metrics) == want_keys
  for key, value in metrics.items():
    assert np.isfinite(np.asarray(value)).all(), key
    if key != "expert_load":
      assert np.asarray(value).shape == (), key
  assert metrics["expert_load"].shape == (e,)
  kept = np.asarray(plan.kept)
  np.testing.assert_allclose(float(metrics["fraction_dropped_assignments"]), 1 - kept.mean(),
                             rtol=1e-6)
  np.testing.assert_allclose(float(metrics["fraction_dropped_tokens"]),
                             1 - kept.any(-1).mean(), rtol=1e-6, atol=1e-7)
  if not train:
    # Capacity ratio 0.5: 16 slots for 32 assignments, at least half of them are dropped.
    assert float(metrics["fraction_dropped_assignments"]) >= 0.5
  filled = np.asarray(plan.expert_of_slot_filled)
  np.testing.assert_allclose(np.asarray(metrics["expert_load"]),
                             filled.mean(0) / plan.capacity, rtol=1e-6)
  assert (np.asarray(metrics["expert_load"]) <= 1.0).all()
  for key in ("importance_loss", "auxiliary_loss") + (("load_loss",) if train else ()):
    assert 0.0 <= float(metrics[key]) <= e - 1  # squared CV of E non-negative values
