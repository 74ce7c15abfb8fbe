"""The pure train step: gradient accumulation, determinism, metrics, MoE auxiliary loss.

Tiny models (1 block, hidden 16, 8x8x3 images, patch 4 -> 4 tokens) keep every jit compilation to
about a second on CPU; each compiled step is reused by several checks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config import from_dict
from runner.config.schema import ModelConfig
from runner.models import build_model
from runner.train import optimizers, schedules
from runner.train.state import TrainState, abstract_params
from runner.train.step import make_train_step

IMAGE = (8, 8, 3)
NUM_CLASSES = 3
_DENSE = dict(name="step_test", image_size=IMAGE[0], patch_size=4, hidden_size=16, num_layers=1,
              mlp_dim=32, num_heads=2)
DENSE = from_dict(ModelConfig, _DENSE)
VMOE = from_dict(ModelConfig, dict(_DENSE, moe=dict(layers=[0], num_experts=4, group_size=2),
                                   router=dict(k=2)))
AUX_WEIGHT = 0.37


def random_params(model, seed=0):
  """Random parameters of the model's shapes, without compiling its initialiser (each eager
  initialiser op would be one XLA compilation). Unlike the real init, the head kernel is not
  zero, so every parameter of the body gets a non-zero gradient."""
  shapes, _ = abstract_params(model, IMAGE)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype), shapes)


def _setup(config, lr=1.0):
  model = build_model(config, NUM_CLASSES)
  params = random_params(model)
  schedule = schedules.make_schedule("linear", lr, total_steps=10, warmup_steps=2)
  tx = optimizers.make_optimizer("sgd", schedule, params, momentum=0.0, grad_clip_norm=None)
  state = TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params))
  return model, tx, schedule, state


def _batch(n=4, seed=0):
  rng = np.random.default_rng(seed)
  images = rng.normal(size=(n,) + IMAGE).astype(np.float32)
  labels = np.eye(NUM_CLASSES, dtype=np.float32)[rng.integers(0, NUM_CLASSES, size=n)]
  return {"image": jnp.asarray(images), "labels": jnp.asarray(labels)}


@pytest.fixture(scope="module")
def dense():
  model, tx, schedule, state = _setup(DENSE)
  steps = {a: jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent",
                                      aux_loss_weight=AUX_WEIGHT, accum_steps=a, seed=0))
           for a in (1, 2)}
  return model, schedule, state, steps


def _leaves_close(a, b, **kw):
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path),
                               **kw)


def test_accumulation_gives_the_full_batch_update(dense):
  model, schedule, state, steps = dense
  batch = _batch()
  new1, m1 = steps[1](state, batch)
  new2, m2 = steps[2](state, batch)
  # Reference gradient, computed directly: mean loss over the whole batch.
  def loss(p):
    logits, _ = model.apply({"params": p}, batch["image"], train=True,
                            rngs={"gating": jax.random.key(0), "dropout": jax.random.key(0)})
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(batch["labels"] * logp, -1))
  grads = jax.jit(jax.grad(loss))(state.params)
  lr = float(schedule(0))
  expected = jax.tree.map(lambda p, g: p - lr * g, state.params, grads)
  _leaves_close(new1.params, expected, rtol=1e-4, atol=1e-6)
  _leaves_close(new2.params, expected, rtol=1e-4, atol=1e-6)
  # Every parameter moved (non-trivial gradients), and the two agree with each other closely.
  for p0, p1 in zip(jax.tree.leaves(state.params), jax.tree.leaves(new1.params)):
    assert not np.array_equal(np.asarray(p0), np.asarray(p1))
  _leaves_close(new1.params, new2.params, rtol=1e-5, atol=1e-6)
  assert float(m1["train/grad_norm"]) == pytest.approx(float(m2["train/grad_norm"]), rel=1e-5)
  # Micro-batch metrics are averaged: same mean loss as the full batch (equal micro-batch sizes).
  assert float(m2["train/loss"]) == pytest.approx(float(m1["train/loss"]), rel=1e-5)
  assert int(new1.step) == int(new2.step) == 1


def test_metrics_and_determinism(dense):
  _, schedule, state, steps = dense
  batch = _batch()
  new_a, m_a = steps[1](state, batch)
  new_b, m_b = steps[1](state, batch)
  for key in ["train/loss", "train/cls_loss", "train/aux_loss", "train/prec@1", "train/lr",
              "train/grad_norm"]:
    assert key in m_a, sorted(m_a)
    assert np.asarray(m_a[key]).shape == ()
  assert not any(k.startswith("moe/") for k in m_a)
  _leaves_close(new_a.params, new_b.params, rtol=0, atol=0)
  assert float(m_a["train/loss"]) == float(m_b["train/loss"])
  assert float(m_a["train/aux_loss"]) == 0.0
  assert float(m_a["train/loss"]) == pytest.approx(float(m_a["train/cls_loss"]), rel=1e-7)
  assert float(m_a["train/lr"]) == pytest.approx(float(schedule(0)), rel=1e-7)
  # The reported lr follows the state's step.
  later = state.replace(step=jnp.asarray(5, jnp.int32))
  new_l, m_l = steps[1](later, batch)
  assert float(m_l["train/lr"]) == pytest.approx(float(schedule(5)), rel=1e-6)
  assert int(new_l.step) == 6


@pytest.fixture(scope="module")
def vmoe():
  model, tx, schedule, state = _setup(VMOE)
  step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent",
                                 aux_loss_weight=AUX_WEIGHT, accum_steps=1, seed=3))
  return model, state, step


def test_vmoe_metrics_and_total_loss(vmoe):
  _, state, step = vmoe
  new, m = step(state, _batch())
  for name in ["importance_loss", "load_loss", "auxiliary_loss", "fraction_dropped_tokens",
               "expert_load"]:
    assert f"moe/layer_0/{name}" in m, sorted(m)
  assert np.asarray(m["moe/layer_0/expert_load"]).shape == (4,)
  aux = float(m["train/aux_loss"])
  assert aux > 0
  assert aux == pytest.approx(float(m["moe/layer_0/auxiliary_loss"]), rel=1e-6)
  assert aux == pytest.approx(0.5 * float(m["moe/layer_0/importance_loss"])
                              + 0.5 * float(m["moe/layer_0/load_loss"]), rel=1e-5)
  assert float(m["train/loss"]) == pytest.approx(
      float(m["train/cls_loss"]) + AUX_WEIGHT * aux, rel=1e-6)
  # (1 - mean over 20 tokens in float32 can be -1.5e-8 rather than 0.)
  assert -1e-6 <= float(m["moe/layer_0/fraction_dropped_tokens"]) <= 1.0
  # Router parameters receive gradients (through the combine weights and the aux loss).
  router0 = state.params["block_0"]["moe"]["router"]["dense"]["kernel"]
  router1 = new.params["block_0"]["moe"]["router"]["dense"]["kernel"]
  assert not np.array_equal(np.asarray(router0), np.asarray(router1))


def test_vmoe_randomness_is_a_function_of_seed_and_step(vmoe):
  model, state, step = vmoe
  batch = _batch()
  _, m_a = step(state, batch)
  _, m_b = step(state, batch)
  _, m_c = step(state.replace(step=jnp.asarray(1, jnp.int32)), batch)
  # Same (seed, step): identical router noise, identical metrics.
  for k in m_a:
    np.testing.assert_array_equal(np.asarray(m_a[k]), np.asarray(m_b[k]), err_msg=k)
  # Another step: other noise, so the noise-dependent load loss changes.
  assert float(m_a["moe/layer_0/load_loss"]) != float(m_c["moe/layer_0/load_loss"])
  # The noise is exactly the one drawn from split(fold_in(key(seed=3), step)).
  @jax.jit
  def forward(params, images):
    rng = jax.random.fold_in(jax.random.key(3), 1)
    gating, dropout = jax.random.split(rng)
    return model.apply({"params": params}, images, train=True,
                       rngs={"gating": gating, "dropout": dropout})
  _, extras = forward(state.params, batch["image"])
  assert float(extras["routing"]["layer_0"]["load_loss"]) == pytest.approx(
      float(m_c["moe/layer_0/load_loss"]), rel=1e-5)
