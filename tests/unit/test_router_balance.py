"""Token choice's sigmoid gates (DeepSeek-V3), global-batch balancing losses (Qiu et al. 2025) and
balance diagnostics (MaxVio, dead and saturated experts; Wang et al. 2024), each against a NumPy
transcription of its equations; and the default options, bit for bit as before them."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config import sections
from runner.config.schema import RouterConfig
from runner.models.moe import balance, routing
from runner.models.moe.routers.token_choice import NoisyTopKRouter, TokenChoice
from moe_reference import (buffers_to_plan_arrays, importance_loss_reference, normal_sf,
                           route_reference, squared_cv_reference)

G, S, D, E, K = 3, 12, 5, 6, 2


def _inputs(seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(G, S, D)).astype(np.float32)
  kernel = (scale * rng.normal(size=(D, E))).astype(np.float32)
  return x, kernel


def _apply(module, kernel, x, *, train, seed=0):
  return jax.jit(lambda v, x: module.apply(v, x, train=train, rngs={
      "gating": jax.random.key(seed)}))({"params": {"dense": {"kernel": kernel}}}, x)


# --- NumPy transcriptions ------------------------------------------------------------------------

def sigmoid_topk_reference(logits: np.ndarray, k: int):
  """DeepSeek-V3 eqs. 15-16 per token: s = sigmoid(u); TOP-k on s (ties: lower id first);
  g_i = s_i / sum_{j in TOP-k} s_j. Returns (experts (..., k), weights (..., k))."""
  s = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
  experts = np.argsort(-s, axis=-1, kind="stable")[..., :k]
  chosen = np.take_along_axis(s, experts, axis=-1)
  return experts, chosen / chosen.sum(-1, keepdims=True)


def balance_loss_reference(per_token: np.ndarray, scope: str) -> float:
  """Squared CV of per-expert sums: per group then averaged ("group"), or of the sums over every
  token of the batch ("batch", Qiu et al. 2025). per_token: (G, S, E)."""
  if scope == "group":
    return float(np.mean([squared_cv_reference(group.sum(0)) for group in per_token]))
  return squared_cv_reference(per_token.sum(axis=(0, 1)))


def diagnostics_reference(experts: np.ndarray, num_experts: int, capacity: int) -> dict:
  """From the TOP-k choices (G, S, k): load_i over the batch, MaxVio = (max load - mean) / mean,
  experts with no assignment, and experts whose buffer (capacity slots per group) was full in at
  least half of the groups."""
  counts = np.zeros((experts.shape[0], num_experts), int)
  for g, group in enumerate(experts):
    for token in group:
      for e in token:
        counts[g, e] += 1
  load = counts.sum(0)
  mean = load.mean()
  full = counts >= capacity
  return {"max_violation": (load.max() - mean) / mean, "dead_experts": int((load == 0).sum()),
          "saturated_experts": int((full.mean(0) >= 0.5).sum())}


# --- sigmoid gates -------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3])
def test_sigmoid_gates_choose_and_weigh_as_deepseek_v3(k):
  rng = np.random.default_rng(k)
  logits = rng.normal(scale=2.0, size=(G, S, E)).astype(np.float32)
  gates = routing.sigmoid_gates(jnp.asarray(logits), k)
  weights, experts = routing.top_k_gates(gates, k)
  want_experts, want_weights = sigmoid_topk_reference(logits, k)
  np.testing.assert_array_equal(np.asarray(experts), want_experts)
  np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("batch_priority", [False, True])
def test_sigmoid_router_routes_the_normalized_weights(batch_priority):
  """The router's plan: Algorithm 1 / 2 on the TOP-k of sigmoid(xW), the combine weights the
  normalized ones, BPR's priority the largest normalized weight; capacity drops some."""
  x, kernel = _inputs(1, scale=1.5)
  module = NoisyTopKRouter(num_experts=E, k=K, capacity_ratio=0.5, gate="sigmoid",
                           batch_priority=batch_priority)
  plan, metrics = _apply(module, kernel, x, train=False)
  logits = x.astype(np.float64) @ kernel
  experts, weights = sigmoid_topk_reference(logits, K)
  np.testing.assert_array_equal(np.asarray(plan.experts), experts)
  # The reference routing of rows whose TOP-k are the normalized weights (and the rest below).
  rows = np.zeros_like(logits)
  np.put_along_axis(rows, experts, weights, axis=-1)
  assert float(metrics["fraction_dropped_assignments"]) > 0
  for g in range(G):
    want = buffers_to_plan_arrays(route_reference(rows[g], K, plan.capacity, batch_priority),
                                  S, K, plan.capacity)
    np.testing.assert_array_equal(np.asarray(plan.slot_of_assignment[g]), want[0])
    np.testing.assert_allclose(np.asarray(plan.combine_weights[g]), want[2], rtol=1e-5)


def test_sigmoid_importance_and_load_losses():
  """Importance on the scores normalized over all experts; the load loss (order of the logits
  only) equals softmax's for the same noise."""
  x, kernel = _inputs(2)
  logits = x.astype(np.float64) @ kernel
  s = 1 / (1 + np.exp(-logits))
  _, metrics = _apply(NoisyTopKRouter(num_experts=E, k=K, gate="sigmoid"), kernel, x,
                      train=False)
  want = balance_loss_reference(s / s.sum(-1, keepdims=True), "group")
  np.testing.assert_allclose(float(metrics["importance_loss"]), want, rtol=1e-4)
  np.testing.assert_allclose(float(metrics["auxiliary_loss"]), 0.5 * want, rtol=1e-4)
  train = {gate: _apply(NoisyTopKRouter(num_experts=E, k=K, gate=gate), kernel, x, train=True,
                        seed=5)[1] for gate in ("softmax", "sigmoid")}
  assert float(train["sigmoid"]["load_loss"]) == float(train["softmax"]["load_loss"])


# --- balance scope -------------------------------------------------------------------------------

@pytest.mark.parametrize("scope", ["group", "batch"])
def test_importance_loss_at_each_scope(scope):
  x, kernel = _inputs(3)
  logits = x.astype(np.float64) @ kernel
  _, metrics = _apply(NoisyTopKRouter(num_experts=E, k=K, balance_scope=scope), kernel, x,
                      train=False)
  gates = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.testing.assert_allclose(float(metrics["importance_loss"]),
                             balance_loss_reference(gates, scope), rtol=1e-4)
  if scope == "group":
    np.testing.assert_allclose(float(metrics["importance_loss"]),
                               importance_loss_reference(logits).mean(), rtol=1e-4)


def test_load_loss_over_the_batch():
  """Eqs. 3-6 with the expected loads summed over every group before the squared CV."""
  rng = np.random.default_rng(4)
  clean = rng.normal(size=(G, S, E)).astype(np.float32)
  noisy = clean + 0.3 * rng.normal(size=(G, S, E)).astype(np.float32)
  sigma = 0.3
  p = np.zeros((G, S, E))
  for g, s in np.ndindex(G, S):
    threshold = sorted(noisy[g, s].astype(np.float64), reverse=True)[K - 1]
    p[g, s] = [normal_sf((threshold - float(c)) / sigma) for c in clean[g, s]]
  for scope in ("group", "batch"):
    got = balance.load_loss(jnp.asarray(clean), jnp.asarray(noisy), sigma, K, scope)
    np.testing.assert_allclose(float(got), balance_loss_reference(p, scope), rtol=1e-4)


def test_batch_scope_with_partitions_sums_each_partitions_groups():
  """A partitioned batch ensemble: block g*P + m is routed by partition m, so the batch's sums
  run over the blocks of one partition, a squared CV per partition, averaged."""
  rng = np.random.default_rng(5)
  values = rng.uniform(size=(4 * 2, S, 3))
  want = np.mean([squared_cv_reference(values[m::2].sum(axis=(0, 1))) for m in range(2)])
  got = routing.squared_cv(balance.expert_sums(jnp.asarray(values), "batch", 2)).mean()
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_batch_scope_changes_the_losses_only():
  x, kernel = _inputs(6)
  plans = {}
  for scope in ("group", "batch"):
    plans[scope], metrics = _apply(NoisyTopKRouter(num_experts=E, k=K, balance_scope=scope),
                                   kernel, x, train=True, seed=1)
    plans[scope + "_metrics"] = metrics
  for a, b in zip(jax.tree.leaves(plans["group"]), jax.tree.leaves(plans["batch"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert (float(plans["batch_metrics"]["importance_loss"])
          < float(plans["group_metrics"]["importance_loss"]))  # a sum of groups evens out


# --- diagnostics ---------------------------------------------------------------------------------

def test_diagnostics_of_a_crafted_routing():
  """k=1, 4 experts, 4 tokens a group, 1 slot each: group 0 sends everything to expert 0, group
  1 sends 0, 0, 1, 2. Loads (6, 1, 1, 0), mean 2: MaxVio 2, expert 3 dead; expert 0 is full in
  both groups, experts 1 and 2 in one of two: 3 saturated."""
  choices = np.array([[0, 0, 0, 0], [0, 0, 1, 2]])
  gates = jnp.asarray(np.eye(4, dtype=np.float32)[choices] * 0.7 + 0.1)
  plan = routing.plan_dispatch(gates, k=1, capacity=1)
  got = balance.diagnostics(plan)
  assert float(got["max_violation"]) == 2.0
  assert float(got["dead_experts"]) == 1.0
  assert float(got["saturated_experts"]) == 3.0


@pytest.mark.parametrize("ratio", [0.5, 1.05, 4.0])
def test_router_diagnostics_match_numpy_counts(ratio):
  x, kernel = _inputs(7, scale=2.0)
  plan, metrics = _apply(NoisyTopKRouter(num_experts=E, k=K, capacity_ratio=ratio), kernel, x,
                         train=False)
  want = diagnostics_reference(np.asarray(plan.experts), E, plan.capacity)
  np.testing.assert_allclose(float(metrics["max_violation"]), want["max_violation"], rtol=1e-6)
  assert float(metrics["dead_experts"]) == want["dead_experts"]
  assert float(metrics["saturated_experts"]) == want["saturated_experts"]
  if ratio == 4.0:  # buffers of 4 tokens' worth: none fills
    assert want["saturated_experts"] == 0


def test_diagnostics_of_a_partitioned_ensemble_count_global_experts():
  """P=2 partitions of 2 experts: blocks 0, 2 route among experts 0-1, blocks 1, 3 among 2-3."""
  local = np.array([[0, 0], [1, 1], [0, 0], [0, 0]])  # each block's 2 tokens' choices, k=1
  gates = jnp.asarray(np.eye(2, dtype=np.float32)[local] * 0.6 + 0.2)
  plan = routing.plan_dispatch(gates, k=1, capacity=1)
  got = balance.diagnostics(plan, partitions=2)
  # Global loads: expert 0: 4, expert 1: 0, expert 2: 2, expert 3: 2; mean 2.
  assert float(got["max_violation"]) == 1.0
  assert float(got["dead_experts"]) == 1.0
  # Full in at least half of their partition's 2 blocks: 0 (both), 2 (block 3), 3 (block 1).
  assert float(got["saturated_experts"]) == 3.0


# --- the defaults, unchanged ---------------------------------------------------------------------

class _RouterBefore(nn.Module):
  """NoisyTopKRouter.__call__ as it was before gates and scopes (one partition), verbatim."""
  num_experts: int
  k: int = 2
  capacity_ratio: float = 1.05
  noise_std: float = 1.0

  @nn.compact
  def __call__(self, x, *, train):
    num_groups, num_tokens, dim = x.shape
    experts = self.num_experts
    logits = nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32,
                      param_dtype=jnp.float32, name="dense")(x.astype(jnp.float32))
    gates_clean = jax.nn.softmax(logits)
    metrics = {"importance_loss": routing.importance_loss(gates_clean).mean()}
    noise_std = self.noise_std / experts
    if train and noise_std > 0:
      noisy = logits + noise_std * jax.random.normal(self.make_rng("gating"), logits.shape)
      gates = jax.nn.softmax(noisy)
      metrics["load_loss"] = routing.load_loss(logits, noisy, noise_std, self.k).mean()
      metrics["auxiliary_loss"] = 0.5 * metrics["importance_loss"] + 0.5 * metrics["load_loss"]
    else:
      gates = gates_clean
      metrics["auxiliary_loss"] = 0.5 * metrics["importance_loss"]
    capacity = routing.expert_capacity(num_tokens, experts, self.k, self.capacity_ratio)
    plan = routing.plan_dispatch(gates, k=self.k, capacity=capacity)
    return plan, metrics


@pytest.mark.parametrize("train", [False, True])
def test_default_options_are_bit_identical_to_before(train):
  x, kernel = _inputs(8)
  kwargs = TokenChoice.module_kwargs(sections.new(RouterConfig), tokens=S, experts=E)
  assert "gate" not in kwargs and "balance_scope" not in kwargs  # the same module arguments
  plan, metrics = _apply(NoisyTopKRouter(num_experts=E, **kwargs), kernel, x, train=train)
  before_plan, before = _apply(_RouterBefore(num_experts=E, k=kwargs["k"]), kernel, x,
                               train=train)
  for a, b in zip(jax.tree.leaves(plan), jax.tree.leaves(before_plan)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for name, value in before.items():
    assert np.asarray(metrics[name]).tobytes() == np.asarray(value).tobytes(), name
  assert math.isfinite(float(metrics["max_violation"]))
