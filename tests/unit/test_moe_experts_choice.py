"""ExpertsChoiceRouter + ExpertsChoicePlan against a NumPy transcription of the reference's
Top-Items-Per-Expert routing (vmoe/moe.py `_get_top_items_per_expert_einsum_dispatcher`): gates
softmax(x W), each expert takes its top-C tokens (ties: lower token index, as `lax.top_k`), the
(S, E, C) one-hot dispatch and combine = gate at the selected pairs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config import sections
from runner.config.schema import RouterConfig
from runner.models.moe import routers
from runner.models.moe.layer import MoeMlpBlock
from runner.models.moe.routers import experts_choice as ec
from runner.models.moe.routers.experts_choice import ExpertsChoiceRouter, experts_capacity
from runner.models.moe.routers.token_choice import CapacityRounding
from router_reference import (compute_capacity, einsum_combine, einsum_dispatch,
                              experts_choice_selection, experts_choice_tensors, is_half_tie,
                              mlp_experts, softmax)

G, S, D, E = 2, 12, 8, 4
METHODS = ("indices", "einsum")

# (capacity_ratio, rounding) -> capacity for S = 12 tokens and E = 4 experts.
CAPACITY_CASES = {
    (1.0, "paper"): 3,        # 12 * 1 / 4 = 3
    (0.25, "paper"): 1,       # 0.75 -> 1: one token per expert
    (1.0, "reference"): 4,    # ceil(3) = 3 -> multiple of 4
    (5.0, "reference"): 12,   # ceil(15) -> 16, clamped to the group's 12 tokens: every token
}


def _key(seed):
  return jax.random.key(seed, impl="rbg")  # compiles faster than threefry on CPU


def _expert_fn(params, buffers):
  """A simple per-expert function on (E, G, C, D) buffers: f_e(z) = tanh(a_e * z + b_e)."""
  a, b = params
  return jnp.tanh(a[:, None, None, :] * buffers + b[:, None, None, :])


def _expert_fn_np(params, buffers):
  a, b = (np.asarray(p, np.float64) for p in params)
  return np.tanh(a[:, None, None, :] * buffers + b[:, None, None, :])


_CACHE = {}


def _runner(**kwargs):
  """One jitted router + dispatch + f + combine (both methods) per router configuration."""
  config = tuple(sorted(kwargs.items()))
  if config not in _CACHE:
    module = ExpertsChoiceRouter(num_experts=E, **kwargs)

    def run(variables, x, key, expert_params, train):
      plan, metrics = module.apply(variables, x, train=train, rngs={"gating": key})
      outs = {}
      for method in METHODS:
        buffers = plan.dispatch(x, method)
        outs[method] = (buffers, plan.combine(_expert_fn(expert_params, buffers), method))
      return plan, metrics, plan.expert_mask(True), outs

    _CACHE[config] = jax.jit(run, static_argnames="train")
  return _CACHE[config]


def _data(kind, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(G, S, D)).astype(np.float32)
  kernel = (0.7 * rng.normal(size=(D, E))).astype(np.float32)
  if kind == "duplicates":  # tokens 5, 9, 11 repeat tokens 0, 2, 3 exactly: tied gates
    x[:, [5, 9, 11]] = x[:, [0, 2, 3]]
  elif kind == "zero_kernel":  # every gate is exactly 1/E: every expert ties over all tokens
    kernel[:] = 0.0
  expert_params = (jnp.asarray(rng.normal(size=(E, D)), jnp.float32),
                   jnp.asarray(rng.normal(size=(E, D)), jnp.float32))
  return jnp.asarray(x), {"params": {"dense": {"kernel": jnp.asarray(kernel)}}}, expert_params


def _reference(x, kernel, gates_used, capacity, expert_params):
  """NumPy: gates, (G, S, E, C) dispatch / combine, buffers and layer output.

  The top-C selection runs on `gates_used` (the router's float32 gates, checked against the NumPy
  softmax separately) so that ulp-level differences cannot flip near-ties."""
  gates = softmax(np.asarray(x, np.float64) @ np.asarray(kernel, np.float64))
  dispatch, combine = zip(*(experts_choice_tensors(gates_used[g], capacity) for g in range(G)))
  dispatch, combine = np.stack(dispatch), np.stack(combine)
  # Combine weights are the gates at the selected pairs (the NumPy gates, not the router's).
  combine = dispatch * gates[:, :, :, None]
  buffers = einsum_dispatch(np.asarray(x), dispatch)
  out = einsum_combine(_expert_fn_np(expert_params, buffers), combine)
  return gates, dispatch, combine, buffers, out


@pytest.mark.parametrize("kind", ["random", "duplicates", "zero_kernel"])
@pytest.mark.parametrize("ratio,rounding", list(CAPACITY_CASES))
def test_matches_reference_top_items_per_expert(ratio, rounding, kind):
  x, variables, expert_params = _data(kind)
  run = _runner(capacity_ratio=ratio, capacity_rounding=rounding)
  plan, metrics, mask, outs = run(variables, x, _key(0), expert_params, train=False)
  capacity = CAPACITY_CASES[(ratio, rounding)]
  assert plan.capacity == capacity and plan.num_experts == E
  gates_used = np.asarray(plan.gates, np.float64)
  kernel = variables["params"]["dense"]["kernel"]
  gates, dispatch, combine, buffers, out = _reference(x, kernel, gates_used, capacity,
                                                      expert_params)
  np.testing.assert_allclose(gates_used, gates, rtol=1e-5, atol=1e-7)
  if kind == "duplicates":  # the ties are real in the router's gates
    np.testing.assert_array_equal(gates_used[:, [5, 9, 11]], gates_used[:, [0, 2, 3]])
  if kind == "zero_kernel":
    assert (gates_used == gates_used[0, 0, 0]).all()
    # Every expert takes the first C tokens, in token order.
    np.testing.assert_array_equal(np.asarray(plan.token_of_slot),
                                  np.tile(np.arange(capacity), (G, E)))
  # Slot e * C + c holds expert e's c-th best token.
  want_tokens = np.array([[t for sel in experts_choice_selection(gates_used[g], capacity)
                           for t in sel] for g in range(G)])
  np.testing.assert_array_equal(np.asarray(plan.token_of_slot), want_tokens)
  # Its combine weight is that token's gate for e (one token per slot: a sum picks it).
  np.testing.assert_allclose(np.asarray(plan.weight_of_slot),
                             combine.sum(1).reshape(G, E * capacity), rtol=1e-5)
  for method in METHODS:
    got_buffers, got_out = outs[method]
    assert got_buffers.shape == (E, G, capacity, D)
    np.testing.assert_allclose(np.asarray(got_buffers), buffers, rtol=1e-6, atol=1e-6,
                               err_msg=method)
    np.testing.assert_allclose(np.asarray(got_out), out, rtol=1e-5, atol=1e-5, err_msg=method)
  np.testing.assert_array_equal(np.asarray(mask), dispatch.any(axis=3))
  # Metrics: counts of experts per token over all groups.
  per_token = dispatch.sum(axis=(2, 3))
  assert float(metrics["auxiliary_loss"]) == 0.0
  np.testing.assert_allclose(float(metrics["experts_per_token_min"]), per_token.min())
  np.testing.assert_allclose(float(metrics["experts_per_token_max"]), per_token.max())
  np.testing.assert_allclose(float(metrics["experts_per_token_mean"]), per_token.mean(),
                             rtol=1e-6)
  np.testing.assert_allclose(float(metrics["fraction_processed_tokens"]),
                             (per_token > 0).mean(), rtol=1e-6)
  np.testing.assert_allclose(float(metrics["fraction_dropped_tokens"]),
                             (per_token == 0).mean(), rtol=1e-6, atol=1e-7)
  if kind == "zero_kernel" and capacity < S:  # tokens C.. are dropped by every expert
    assert float(metrics["fraction_dropped_tokens"]) == pytest.approx(1 - capacity / S)


@pytest.mark.parametrize("ratio,rounding", list(CAPACITY_CASES))
def test_every_expert_holds_exactly_capacity_distinct_tokens(ratio, rounding):
  x, variables, expert_params = _data("random", seed=1)
  plan, _, mask, outs = _runner(capacity_ratio=ratio, capacity_rounding=rounding)(
      variables, x, _key(0), expert_params, train=False)
  c = plan.capacity
  tokens = np.asarray(plan.token_of_slot).reshape(G, E, c)
  assert ((tokens >= 0) & (tokens < S)).all()
  for g in range(G):
    for e in range(E):
      assert len(set(tokens[g, e].tolist())) == c
  # The mask counts C tokens per expert, and the einsum buffers are one-hot rows of x.
  np.testing.assert_array_equal(np.asarray(mask).sum(axis=1), np.full((G, E), c))
  buffers = np.asarray(outs["einsum"][0])
  np.testing.assert_allclose(buffers, np.asarray(x)[np.arange(G)[None, :, None],
                                                    tokens.transpose(1, 0, 2)], rtol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_permuting_tokens_permutes_outputs(method):
  x, variables, expert_params = _data("random", seed=2)
  perm = np.random.default_rng(5).permutation(S)
  run = _runner(capacity_ratio=1.0, capacity_rounding="paper")
  plan, _, _, outs = run(variables, x, _key(0), expert_params, train=False)
  plan_p, _, _, outs_p = run(variables, x[:, perm], _key(0), expert_params, train=False)
  gates = np.asarray(plan.gates)
  assert all(len(np.unique(gates[g, :, e])) == S for g in range(G) for e in range(E))  # no ties
  out, out_p = np.asarray(outs[method][1]), np.asarray(outs_p[method][1])
  np.testing.assert_allclose(out_p, out[:, perm], rtol=1e-5, atol=1e-6)
  # The same tokens are picked (renamed by the permutation), so the dropped set permutes too.
  np.testing.assert_array_equal(np.asarray(plan_p.expert_mask()),
                                np.asarray(plan.expert_mask())[:, perm])
  assert (np.abs(out).sum(-1) == 0).any()  # some tokens are dropped: a non-trivial check


_GRAD_CACHE = {}


def _loss_and_grad(method):
  if method not in _GRAD_CACHE:
    module = ExpertsChoiceRouter(num_experts=E, capacity_ratio=1.0, noise_std=0.0)

    def loss(kernel, x, expert_params, r):
      plan, _ = module.apply({"params": {"dense": {"kernel": kernel}}}, x, train=False)
      y = plan.combine(_expert_fn(expert_params, plan.dispatch(x, method)), method)
      return jnp.sum(y * r), plan.token_of_slot

    _GRAD_CACHE[method] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  return _GRAD_CACHE[method]


def test_gradients_agree_between_indices_and_einsum():
  x, variables, expert_params = _data("random", seed=3)
  kernel = variables["params"]["dense"]["kernel"]
  r = jnp.asarray(np.random.default_rng(9).normal(size=(G, S, D)), jnp.float32)
  results = {m: _loss_and_grad(m)(kernel, x, expert_params, r) for m in METHODS}
  (loss_i, slots_i), (gk_i, gx_i) = results["indices"]
  (loss_e, slots_e), (gk_e, gx_e) = results["einsum"]
  np.testing.assert_array_equal(np.asarray(slots_i), np.asarray(slots_e))
  np.testing.assert_allclose(float(loss_i), float(loss_e), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(gk_i), np.asarray(gk_e), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gx_i), np.asarray(gx_e), rtol=1e-4, atol=1e-5)
  assert np.abs(np.asarray(gk_i)).max() > 1e-3 and np.abs(np.asarray(gx_i)).max() > 1e-3
  # Dropped tokens get gradient only through nothing: zero rows of d loss / d x.
  picked = np.zeros((G, S), bool)
  for g in range(G):
    picked[g, np.asarray(slots_i[g])] = True
  assert (~picked).any()
  np.testing.assert_array_equal(np.asarray(gx_i)[~picked], 0.0)
  # A central finite difference along random directions (the selection does not change).
  rng = np.random.default_rng(11)
  for argnum, (grad, h) in enumerate(((gk_i, 1e-3), (gx_i, 1e-3))):
    base = [kernel, x]
    direction = rng.normal(size=base[argnum].shape).astype(np.float32)
    values = []
    for sign in (1, -1):
      args = list(base)
      args[argnum] = base[argnum] + sign * h * direction
      (value, slots), _ = _loss_and_grad("indices")(*args, expert_params, r)
      np.testing.assert_array_equal(np.asarray(slots), np.asarray(slots_i))
      values.append(float(value))
    fd = (values[0] - values[1]) / (2 * h)
    np.testing.assert_allclose(fd, float(np.sum(np.asarray(grad) * direction)), rtol=2e-2,
                               atol=1e-3)


def test_training_noise_std_is_noise_std_over_num_experts():
  """With W = 0 the logits are pure noise; log(gates) centred per token is eps - mean(eps), of
  variance sigma^2 (1 - 1/E). sigma = 3 / 4 (not 3, nor 1 / 4)."""
  noise_std = 3.0
  x, _, expert_params = _data("random")
  variables = {"params": {"dense": {"kernel": jnp.zeros((D, E), jnp.float32)}}}
  run = _runner(capacity_ratio=1.0, noise_std=noise_std)
  centred = []
  for seed in range(8):  # 8 draws x 24 tokens x (E - 1) = 576 degrees of freedom
    plan, _, _, _ = run(variables, x, _key(seed), expert_params, train=True)
    log_g = np.log(np.asarray(plan.gates, np.float64))
    centred.append((log_g - log_g.mean(-1, keepdims=True)).reshape(-1))
  centred = np.concatenate(centred)
  sigma_hat = np.sqrt(np.mean(centred ** 2) / (1 - 1 / E))
  # Relative standard error ~ 1/sqrt(2 * 576) ~ 3%.
  np.testing.assert_allclose(sigma_hat, noise_std / E, rtol=0.15)
  # Evaluation is noise-free: the gates are exactly uniform and two keys agree.
  plan_a, _, _, outs_a = run(variables, x, _key(1), expert_params, train=False)
  plan_b, _, _, outs_b = run(variables, x, _key(2), expert_params, train=False)
  np.testing.assert_allclose(np.asarray(plan_a.gates), 1.0 / E, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(outs_a["indices"][1]), np.asarray(outs_b["indices"][1]))


def test_training_noise_changes_the_selection_and_zero_noise_does_not():
  x, variables, expert_params = _data("random", seed=4)
  kernel = variables["params"]["dense"]["kernel"]
  clean = softmax(np.asarray(x, np.float64) @ np.asarray(kernel, np.float64))
  noisy = _runner(capacity_ratio=1.0, noise_std=3.0)  # shared with the test above
  p1, _, _, _ = noisy(variables, x, _key(1), expert_params, train=True)
  p1b, _, _, _ = noisy(variables, x, _key(1), expert_params, train=True)
  p2, _, _, _ = noisy(variables, x, _key(2), expert_params, train=True)
  np.testing.assert_array_equal(np.asarray(p1.gates), np.asarray(p1b.gates))  # reproducible
  assert not np.allclose(np.asarray(p1.gates), clean, atol=1e-3)
  assert not np.array_equal(np.asarray(p1.token_of_slot), np.asarray(p2.token_of_slot))
  # The selection is the top-C of the noisy gates the plan carries.
  for g in range(G):
    want = [t for sel in experts_choice_selection(np.asarray(p1.gates[g], np.float64), 3)
            for t in sel]
    np.testing.assert_array_equal(np.asarray(p1.token_of_slot[g]), want)
  quiet = _runner(capacity_ratio=1.0, noise_std=0.0)
  q, _, _, _ = quiet(variables, x, _key(1), expert_params, train=True)
  np.testing.assert_allclose(np.asarray(q.gates), clean, rtol=1e-5, atol=1e-7)


def test_eval_capacity_ratio_applies_only_when_not_training():
  x, variables, expert_params = _data("random", seed=6)
  run = _runner(capacity_ratio=1.0, eval_capacity_ratio=0.25, noise_std=0.0)
  plan_train, _, _, _ = run(variables, x, _key(0), expert_params, train=True)
  plan_eval, metrics, _, outs = run(variables, x, _key(0), expert_params, train=False)
  assert plan_train.capacity == 3 and plan_eval.capacity == 1
  gates = np.asarray(plan_eval.gates, np.float64)
  for g in range(G):
    want = [sel[0] for sel in experts_choice_selection(gates[g], 1)]
    np.testing.assert_array_equal(np.asarray(plan_eval.token_of_slot[g]), want)
    np.testing.assert_array_equal(np.asarray(plan_eval.token_of_slot[g]),
                                  gates[g].argmax(axis=0))
  assert outs["indices"][0].shape == (E, G, 1, D)
  # The family (found by name) answers the same capacities from a `model.router` config.
  family = routers.family("experts_choice")
  assert family is ec.ExpertsChoice and family.module is ExpertsChoiceRouter
  router = sections.new(RouterConfig, type="experts_choice", capacity_ratio=1.0, eval_capacity_ratio=0.25)
  assert family.capacity(router, S, E, train=True) == 3
  assert family.capacity(router, S, E, train=False) == 1
  assert family.module_kwargs(router, tokens=S, experts=E) == dict(
      capacity_ratio=1.0, eval_capacity_ratio=0.25, noise_std=1.0, capacity_rounding="paper")
  router = sections.new(RouterConfig, type="experts_choice", capacity_ratio=1.0, noise_std=0.0,
                        capacity_rounding=CapacityRounding.reference)
  assert family.capacity(router, S, E, train=False) == 4  # no eval ratio: capacity_ratio
  assert family.capacity(router, S, E, train=True) == 4
  kwargs = family.module_kwargs(router, tokens=S, experts=E)
  assert kwargs == dict(capacity_ratio=1.0, eval_capacity_ratio=None, noise_std=0.0,
                        capacity_rounding="reference")
  assert family.experts_per_token(router, S, E, 4) == pytest.approx(E * 4 / S)


def test_capacity_formula_matches_the_reference():
  ratios = (0.1, 0.25, 0.3, 0.5, 0.7, 1.0, 1.05, 1.25, 1.5, 2.0, 3.0, 5.0)
  checked_ties = 0
  for tokens in (1, 2, 3, 5, 8, 10, 12, 16, 30, 45, 64, 196, 400):
    for experts in (1, 2, 3, 4, 8, 16, 32):
      for ratio in ratios:
        # "reference": ceil, multiple of 4; ours clamps to the group's tokens (the reference
        # would build a top-k of more items than there are).
        want = min(tokens, compute_capacity(tokens, experts, ratio, "ceil", 4))
        assert experts_capacity(tokens, experts, ratio, "reference") == want, (tokens, experts,
                                                                              ratio)
        # "paper": round half up, at least 1.
        got = experts_capacity(tokens, experts, ratio, "paper")
        try:
          half_up = compute_capacity(tokens, experts, ratio, "round", 1, half="up")
        except ValueError:  # rounds to 0: the reference raises, ours takes 1
          half_up = 1
        assert got == min(tokens, half_up), (tokens, experts, ratio)
        if is_half_tie(tokens, experts, ratio):
          checked_ties += 1
        else:  # away from exact halves, the same as the reference's round
          try:
            want = compute_capacity(tokens, experts, ratio, "round", 1)
          except ValueError:
            want = 1
          assert got == min(tokens, want), (tokens, experts, ratio)
  assert checked_ties > 10
  # Worked cases.
  assert experts_capacity(12, 4, 1.0, "reference") == 4
  assert experts_capacity(12, 4, 5.0, "reference") == 12  # the reference: 16 > 12 tokens
  assert experts_capacity(10, 4, 1.0, "paper") == 3       # 2.5 half up (Python's round: 2)
  assert experts_capacity(45, 3, 0.7, "paper") == 11      # exactly 10.5, not 10.4999...
  assert experts_capacity(12, 4, 0.25, "paper") == 1      # 0.75
  assert experts_capacity(12, 16, 0.25, "paper") == 1     # 0.1875: at least one
  assert experts_capacity(400, 8, 1.05, "reference") == 56  # 52.500...01 -> 53 -> 56


_BLOCK_CACHE = {}


@pytest.mark.parametrize("method", METHODS)
def test_moe_block_with_experts_choice_router_matches_numpy(method):
  """The whole layer: x (4 images, 6 tokens) in groups of 2 images, real MLP experts."""
  mlp = 16
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.normal(size=(4, 6, D)), jnp.float32)
  kernel = jnp.asarray(0.7 * rng.normal(size=(D, E)), jnp.float32)
  weights = tuple(jnp.asarray(0.3 * rng.normal(size=shape), jnp.float32)
                  for shape in ((E, D, mlp), (E, mlp), (E, mlp, D), (E, D)))
  params = {"router": {"dense": {"kernel": kernel}},
            "experts": dict(zip(("fc1_kernel", "fc1_bias", "fc2_kernel", "fc2_bias"), weights))}
  if method not in _BLOCK_CACHE:
    block = MoeMlpBlock(num_experts=E, mlp_dim=mlp, group_size=2, dispatcher=method,
                        router={"type": "experts_choice", "capacity_ratio": 1.0,
                                "noise_std": 0.0})
    _BLOCK_CACHE[method] = jax.jit(lambda p, x: block.apply({"params": p}, x, train=False,
                                                            mutable=["intermediates"]))
  (y, metrics), state = _BLOCK_CACHE[method](params, x)
  groups = np.asarray(x, np.float64).reshape(G, S, D)
  gates = softmax(groups @ np.asarray(kernel, np.float64))
  dispatch = np.stack([experts_choice_tensors(gates[g], 3)[0] for g in range(G)])
  buffers = einsum_dispatch(groups, dispatch)
  want = einsum_combine(mlp_experts(weights, buffers), dispatch * gates[..., None])
  np.testing.assert_allclose(np.asarray(y), want.reshape(4, 6, D), rtol=1e-5, atol=1e-5)
  assert np.abs(want).max() > 0.1
  routed = np.asarray(state["intermediates"]["routed_mask"][0])
  np.testing.assert_array_equal(routed, dispatch.any(3).reshape(4, 6, E))
  assert float(metrics["fraction_dropped_tokens"]) == pytest.approx(
      (dispatch.sum((2, 3)) == 0).mean())
