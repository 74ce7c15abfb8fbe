"""make_optimizer against optax's own reference optimizers, and per-parameter weight decay rules."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from runner.config import from_dict
from runner.config.schema import ModelConfig
from runner.models import build_model
from runner.config.registries import OPTIMIZERS
from runner.train.optimizers import make_optimizer, param_names, weight_decay_tree
from runner.train.state import abstract_params

TINY_VMOE = from_dict(ModelConfig, dict(
    name="optim_test", image_size=8, patch_size=4, hidden_size=16, num_layers=2, mlp_dim=32,
    num_heads=2, moe=dict(layers=[1], num_experts=4, group_size=2), router=dict(k=2)))


@pytest.fixture(scope="module")
def vit_param_tree():
  """A realistic (abstract) parameter tree: 2 blocks, block_1 is MoE; token classifier."""
  model = build_model(TINY_VMOE, num_classes=5)
  params, _ = abstract_params(model, (8, 8, 3))
  return params


def _flat_names(tree):
  return {"/".join(str(k.key) for k in path): v
          for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_param_names_are_slash_joined_paths(vit_param_tree):
  names = set(jax.tree.leaves(param_names(vit_param_tree)))
  for expected in ["head/kernel", "head/bias", "cls", "pos_embedding", "embedding_kernel",
                   "block_0/mlp/fc1/kernel", "block_0/attention/qkv_kernel",
                   "block_1/moe/experts/fc1_kernel", "block_1/moe/router/dense/kernel",
                   "encoder_norm/scale"]:
    assert expected in names, sorted(names)


def test_weight_decay_tree_first_full_match_wins_unmatched_get_zero(vit_param_tree):
  rules = [["head/kernel", 3.0], [".*kernel", 0.03], ["block_1/moe/.*", 7.0], ["bias", 9.0]]
  decay = _flat_names(weight_decay_tree(vit_param_tree, rules))
  assert decay.keys() == _flat_names(vit_param_tree).keys()
  assert decay["head/kernel"] == 3.0  # first rule, although ".*kernel" also matches
  assert decay["block_0/mlp/fc1/kernel"] == 0.03
  assert decay["embedding_kernel"] == 0.03
  assert decay["block_0/attention/qkv_kernel"] == 0.03
  # block_1/moe/experts/fc1_kernel matches ".*kernel" before "block_1/moe/.*".
  assert decay["block_1/moe/experts/fc1_kernel"] == 0.03
  assert decay["block_1/moe/router/dense/kernel"] == 0.03
  assert decay["block_1/moe/experts/fc1_bias"] == 7.0
  # "bias" must match the whole name, not a part of it: biases elsewhere get no decay.
  assert decay["head/bias"] == 0.0
  assert decay["block_0/mlp/fc1/bias"] == 0.0
  assert decay["pos_embedding"] == 0.0
  assert decay["cls"] == 0.0
  assert decay["encoder_norm/scale"] == 0.0


def test_weight_decay_tree_partial_pattern_does_not_match(vit_param_tree):
  decay = _flat_names(weight_decay_tree(vit_param_tree, [["kernel", 1.0], ["head", 2.0]]))
  assert set(decay.values()) == {0.0}


def test_weight_decay_tree_float_applies_to_everything(vit_param_tree):
  decay = jax.tree.leaves(weight_decay_tree(vit_param_tree, 0.1))
  assert len(decay) == len(jax.tree.leaves(vit_param_tree))
  assert all(d == 0.1 and isinstance(d, float) for d in decay)


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {"dense": {"kernel": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                    "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32)},
          "scale": jnp.asarray(rng.normal(size=(2,)), jnp.float32)}


def _grads(step):
  rng = np.random.default_rng(100 + step)
  return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), _params())


def _run(tx, params, steps):
  state = tx.init(params)
  for i in range(steps):
    updates, state = tx.update(_grads(i), state, params)
    params = optax.apply_updates(params, updates)
  return params


def _assert_trees_close(a, b, **kw):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw), a, b)


def test_adam_with_float_weight_decay_equals_optax_adamw():
  lr, wd = 0.05, 0.1
  params = _params()
  ours = make_optimizer("adam", lambda step: lr, params, b1=0.8, b2=0.95, eps=1e-6,
                        weight_decay=wd, grad_clip_norm=None)
  ref = optax.adamw(learning_rate=lr, b1=0.8, b2=0.95, eps=1e-6, weight_decay=wd)
  got, want = _run(ours, params, 5), _run(ref, params, 5)
  _assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
  # And the decay did something: differs from plain adam.
  plain = _run(optax.adam(lr, b1=0.8, b2=0.95, eps=1e-6), params, 5)
  assert not np.allclose(np.asarray(got["dense"]["kernel"]), np.asarray(plain["dense"]["kernel"]))


def test_adam_weight_decay_is_scaled_by_the_schedule():
  # With a schedule, the decay follows lr(t): optax.adamw with the same schedule.
  sched = optax.linear_schedule(0.1, 0.01, 4)
  params = _params(1)
  ours = make_optimizer("adam", sched, params, weight_decay=0.5, grad_clip_norm=None)
  ref = optax.adamw(learning_rate=sched, weight_decay=0.5)
  _assert_trees_close(_run(ours, params, 4), _run(ref, params, 4), rtol=1e-5, atol=1e-6)


def test_sgd_momentum_without_decay_equals_optax_sgd():
  lr = 0.1
  params = _params()
  ours = make_optimizer("sgd", lambda step: lr, params, momentum=0.9, weight_decay=0.0,
                        grad_clip_norm=None)
  ref = optax.sgd(lr, momentum=0.9)
  _assert_trees_close(_run(ours, params, 4), _run(ref, params, 4), rtol=1e-5, atol=1e-6)


def test_sgd_nesterov_equals_optax_sgd_nesterov():
  params = _params()
  ours = make_optimizer("sgd", lambda step: 0.1, params, momentum=0.9, nesterov=True,
                        grad_clip_norm=None)
  ref = optax.sgd(0.1, momentum=0.9, nesterov=True)
  _assert_trees_close(_run(ours, params, 3), _run(ref, params, 3), rtol=1e-5, atol=1e-6)


def test_sgd_weight_decay_shrinks_params_by_one_minus_lr_wd_per_step():
  lr, wd, steps = 0.1, 0.5, 3
  params = _params()
  tx = make_optimizer("sgd", lambda step: lr, params, momentum=0.0, weight_decay=wd,
                      grad_clip_norm=None)
  state = tx.init(params)
  p = params
  zeros = jax.tree.map(jnp.zeros_like, params)
  for _ in range(steps):
    updates, state = tx.update(zeros, state, p)
    p = optax.apply_updates(p, updates)
  want = jax.tree.map(lambda x: x * (1 - lr * wd) ** steps, params)
  _assert_trees_close(p, want, rtol=1e-6)


def test_sgd_weight_decay_rules_only_decay_matching_params():
  lr, wd = 0.1, 0.5
  params = _params()
  tx = make_optimizer("sgd", lambda step: lr, params, momentum=0.0,
                      weight_decay=[["dense/kernel", wd]], grad_clip_norm=None)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  p = optax.apply_updates(params, updates)
  np.testing.assert_allclose(p["dense"]["kernel"], params["dense"]["kernel"] * (1 - lr * wd),
                             rtol=1e-6)
  np.testing.assert_array_equal(p["dense"]["bias"], params["dense"]["bias"])
  np.testing.assert_array_equal(p["scale"], params["scale"])


def test_global_norm_clipping_caps_the_update():
  params = {"w": jnp.zeros((4,)), "v": jnp.zeros((3,))}
  grads = {"w": jnp.asarray([30.0, 0.0, 40.0, 0.0]), "v": jnp.zeros((3,))}  # norm 50
  lr, clip = 1.0, 2.0
  tx = make_optimizer("sgd", lambda step: lr, params, momentum=0.0, grad_clip_norm=clip)
  updates, _ = tx.update(grads, tx.init(params), params)
  assert float(optax.global_norm(updates)) == pytest.approx(lr * clip, rel=1e-6)
  # Direction preserved: -lr * clip * g / |g|.
  np.testing.assert_allclose(updates["w"], [-1.2, 0.0, -1.6, 0.0], rtol=1e-6)
  # A small gradient is left alone.
  small = {"w": jnp.asarray([0.3, 0.0, 0.4, 0.0]), "v": jnp.zeros((3,))}
  updates, _ = tx.update(small, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], [-0.3, 0.0, -0.4, 0.0], rtol=1e-6)


def test_grad_clip_none_or_zero_disables_clipping():
  params = {"w": jnp.zeros((2,))}
  grads = {"w": jnp.asarray([300.0, 400.0])}
  for clip in (None, 0.0):
    tx = make_optimizer("sgd", lambda step: 1.0, params, momentum=0.0, grad_clip_norm=clip)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], [-300.0, -400.0])


def test_adafactor_decreases_a_quadratic():
  target = {"a": jnp.asarray(np.random.default_rng(0).normal(size=(8, 6)), jnp.float32),
            "b": jnp.asarray([1.0, -2.0, 3.0])}
  params = jax.tree.map(jnp.zeros_like, target)
  loss = lambda p: sum(jnp.sum((x - t) ** 2) for x, t in zip(jax.tree.leaves(p),
                                                            jax.tree.leaves(target)))
  tx = make_optimizer("adafactor", lambda step: 0.05, params, b1=0.9, grad_clip_norm=1.0,
                      weight_decay=[[".*a", 0.001]])
  state = tx.init(params)

  @jax.jit
  def step(p, s):
    g = jax.grad(loss)(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  start = float(loss(params))
  for _ in range(60):
    params, state = step(params, state)
  end = float(loss(params))
  assert np.isfinite(end)
  assert end < 0.3 * start, (start, end)


def test_adam_ignores_options_of_other_optimizers():
  params = _params()
  tx = make_optimizer("adam", lambda step: 0.1, params, momentum=0.5, lr=0.1, name_unused="x",
                      grad_clip_norm=None)
  ref = optax.adam(0.1)
  _assert_trees_close(_run(tx, params, 2), _run(ref, params, 2), rtol=1e-5, atol=1e-6)


def test_unknown_optimizer_raises_with_valid_names():
  with pytest.raises(ValueError, match="optim.name='rmsprop' is not a known optimizer") as e:
    make_optimizer("rmsprop", lambda step: 0.1, _params())
  for name in OPTIMIZERS.names():
    assert name in str(e.value)


# --- Adafactor: big_vision's scale_by_adafactor, as vmoe's scale_by_big_vision_adafactor -------

def _numpy_adafactor_unfactored(grads, beta2_cap, b1, eps=1e-30, exponent=0.8):
  """Updates (lr 1, no weight decay, no update clipping) for a parameter too small to factor:
  beta_i = min(beta2_cap, 1 - (i + 1)^-0.8), v = beta v + (1 - beta)(g^2 + eps), u = g / sqrt(v),
  then momentum m = b1 m + (1 - b1) u (no debiasing); the step is -m."""
  v = m = 0.0
  out = []
  for i, g in enumerate(grads):
    beta = min(beta2_cap, 1.0 - (i + 1.0) ** -exponent)
    v = beta * v + (1 - beta) * (g ** 2 + eps)
    u = g / np.sqrt(v)
    m = b1 * m + (1 - b1) * u if b1 else u
    out.append(-m)
  return out


@pytest.mark.parametrize("beta2_cap,b1", [(0.5, 0.0), (0.5, 0.9), (1.0, 0.9), (0.999, 0.9)])
def test_adafactor_second_moment_decay_is_capped(beta2_cap, b1):
  rng = np.random.default_rng(0)
  grads = [rng.normal(size=5).astype(np.float32) for _ in range(8)]
  params = {"w": jnp.zeros(5, jnp.float32)}  # 1-D: never factored
  tx = make_optimizer("adafactor", lambda step: 1.0, params, b1=b1, beta2_cap=beta2_cap,
                      clipping_threshold=None, grad_clip_norm=None)
  state = tx.init(params)
  want = _numpy_adafactor_unfactored([g.astype(np.float64) for g in grads], beta2_cap, b1)
  for g, w in zip(grads, want):
    updates, state = tx.update({"w": jnp.asarray(g)}, state, params)
    np.testing.assert_allclose(np.asarray(updates["w"]), w, rtol=2e-5, atol=1e-6)
  if beta2_cap == 0.5:  # the cap bites from the third step (1 - 3^-0.8 = 0.585): uncapped differs
    uncapped = _numpy_adafactor_unfactored([g.astype(np.float64) for g in grads], 1.0, b1)
    assert not np.allclose(uncapped[-1], want[-1], rtol=1e-3)


def test_adafactor_decay_rate_schedule():
  from runner.train.optimizers import adafactor_decay_rate_fn
  fn = adafactor_decay_rate_fn(0.999)
  steps = np.array([0, 1, 9, 1000, 5622, 5624, 10 ** 6])
  got = np.asarray(fn(jnp.asarray(steps), 0.8))
  want = np.minimum(0.999, 1.0 - (steps + 1.0) ** -0.8)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got[0] == 0.0 and got[-1] == np.float32(0.999)  # capped: (t)^-0.8 < 1e-3 past t ~ 5623
  assert got[4] < np.float32(0.999)


@pytest.mark.parametrize("min_dim,factored", [(32, True), (41, False), (128, False)])
def test_adafactor_factors_by_min_dim_size(min_dim, factored):
  params = {"k": jnp.zeros((40, 36), jnp.float32)}
  tx = make_optimizer("adafactor", lambda step: 1.0, params, min_dim_size_to_factor=min_dim)
  rms_state = tx.init(params)[1][0]  # (clip, precondition chain, decay, lr): the factored RMS
  # Factored: a (36,) and a (40,) statistic and a dummy full one; else the full (40, 36) one.
  assert {rms_state.v_row["k"].shape, rms_state.v_col["k"].shape} == (
      {(36,), (40,)} if factored else {(1,)})
  assert rms_state.v["k"].shape == ((1,) if factored else (40, 36))
