"""Checkpointer (Orbax) round trips, retention, and the path helpers of runner.checkpoints.checkpoint.

One module-scoped fixture writes three steps (keep=2) once; the tests read them back.
"""
from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from runner.checkpoints.checkpoint import (CheckpointError, Checkpointer, load_params, locate, param_shapes,
                               read_config)
from runner.errors import UserError

CONFIG = {"model": {"name": "vmoe_tiny", "hidden_size": 32, "moe": {"layers": [1, 3],
                                                                    "num_experts": 4}},
          "optim": {"name": "adam", "lr": 0.001, "weight_decay": [["head/kernel", 3.0]]},
          "data": {"test_split": None}, "seed": 7, "note": "ünïcode"}


def _params(scale):
  rng = np.random.default_rng(0)
  return {"block_0": {"mlp": {"fc1": {"kernel": jnp.asarray(rng.normal(size=(3, 4)) * scale,
                                                            jnp.float32),
                                      "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32)}}},
          "pos_embedding": jnp.asarray(rng.normal(size=(1, 4, 2)), jnp.bfloat16),
          "head": {"kernel": jnp.full((2, 5), scale, jnp.float32)}}


def _opt_state_fn(tx):
  @jax.jit  # one compilation instead of one per eager optax op
  def run(params):
    state = tx.init(params)
    for i in range(2):  # non-trivial moments and count
      grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.1 * (i + 1), p.dtype), params)
      _, state = tx.update(grads, state, params)
    return state
  return run


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("run")
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  ckpt = Checkpointer(workdir / "checkpoints", keep=2, every_steps=0)
  states = {}
  opt_state_of = _opt_state_fn(tx)
  for step in (1, 2, 3):
    params = _params(float(step))
    opt_state = opt_state_of(params)
    states[step] = (params, opt_state)
    ckpt.save(step, params, opt_state, meta={"step": step, "position": 32 * step},
              config=dict(CONFIG, seed=step))
  ckpt.close()
  return workdir, tx, states


def _assert_tree_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.shape == w.shape, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


def test_keep_retains_only_the_latest_steps(saved):
  workdir, _, _ = saved
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [2, 3]
  reader = Checkpointer(workdir / "checkpoints", keep=2)
  try:
    assert reader.latest_step() == 3
  finally:
    reader.close()


def test_save_restore_round_trip_is_exact(saved):
  workdir, tx, states = saved
  params, opt_state = states[3]
  abstract_params = jax.eval_shape(lambda: params)
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  ckpt = Checkpointer(workdir / "checkpoints", keep=2)
  try:
    got_params, got_opt, meta = ckpt.restore(3, abstract_params, abstract_opt)
  finally:
    ckpt.close()
  _assert_tree_equal(got_params, params)
  _assert_tree_equal(got_opt, opt_state)
  # The restored optimizer state is usable: one more update gives the same result as the original.
  grads = jax.tree.map(jnp.ones_like, params)
  update = jax.jit(tx.update)
  u1, _ = update(grads, got_opt, got_params)
  u2, _ = update(grads, opt_state, params)
  _assert_tree_equal(u1, u2)
  assert meta == {"step": 3, "position": 96}
  assert int(got_opt[1][0].count) == 2


def test_read_config_and_load_params(saved):
  workdir, _, states = saved
  assert read_config(str(workdir)) == dict(CONFIG, seed=3)
  params, config, step = load_params(str(workdir))
  assert step == 3 and config == dict(CONFIG, seed=3)
  for leaf in jax.tree.leaves(params):
    assert isinstance(leaf, np.ndarray)
  _assert_tree_equal(params, jax.tree.map(np.asarray, states[3][0]))
  # An explicit step folder loads that step, not the latest.
  params2, config2, step2 = load_params(str(workdir / "checkpoints" / "2"))
  assert step2 == 2 and config2["seed"] == 2
  _assert_tree_equal(params2, jax.tree.map(np.asarray, states[2][0]))


EXPECTED_SHAPES = {"block_0": {"mlp": {"fc1": {"kernel": (3, 4), "bias": (4,)}}},
                   "pos_embedding": (1, 4, 2), "head": {"kernel": (2, 5)}}


def test_param_shapes_from_metadata(saved):
  workdir, _, _ = saved
  shapes = param_shapes(str(workdir / "checkpoints"))
  assert shapes["block_0"]["mlp"]["fc1"]["kernel"] == (3, 4)
  assert shapes["block_0"]["mlp"]["fc1"]["bias"] == (4,)
  assert shapes["pos_embedding"] == (1, 4, 2)
  assert shapes["head"]["kernel"] == (2, 5)
  assert sorted(shapes.keys()) == ["block_0", "head", "pos_embedding"]


def test_param_shapes_is_a_plain_dict(saved):
  workdir, _, _ = saved
  shapes = param_shapes(str(workdir))
  assert isinstance(shapes, dict)
  assert shapes == EXPECTED_SHAPES


def test_locate_workdir_checkpoints_dir_and_step_dir(saved):
  workdir, _, _ = saved
  ckpts = workdir / "checkpoints"
  assert locate(str(workdir)) == (ckpts, 3)
  assert locate(str(ckpts)) == (ckpts, 3)
  assert locate(str(ckpts / "3")) == (ckpts, 3)
  assert locate(str(ckpts / "2")) == (ckpts, 2)


def test_locate_nonexistent_path_raises_a_helpful_error(saved):
  workdir, _, _ = saved
  missing = workdir / "checkpoints" / "1"  # deleted by keep=2
  with pytest.raises(CheckpointError) as e:
    locate(str(missing))
  message = str(e.value)
  assert str(missing) in message and "does not exist" in message
  assert "checkpoints/" in message  # says what to give instead
  assert isinstance(e.value, UserError)
  with pytest.raises(CheckpointError, match="does not exist"):
    load_params(str(workdir / "nope"))


def test_locate_empty_dir_raises_a_helpful_error(tmp_path):
  empty = tmp_path / "empty"
  (empty / "checkpoints").mkdir(parents=True)
  with pytest.raises(CheckpointError) as e:
    locate(str(empty))
  message = str(e.value)
  assert "no checkpoint found" in message and str(empty) in message
  assert "checkpoints/<step>" in message
  # A step folder without params (an unfinished save) is not a checkpoint either.
  (empty / "checkpoints" / "5").mkdir()
  with pytest.raises(CheckpointError, match="no checkpoint found"):
    locate(str(empty / "checkpoints"))
  with pytest.raises(CheckpointError, match="no checkpoint found"):
    read_config(str(empty))


def test_locate_copied_workdir(saved, tmp_path):
  """A workdir copied elsewhere is still found (the manager directory is the copied one)."""
  workdir, _, _ = saved
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  assert locate(str(copy)) == (copy / "checkpoints", 3)
  assert read_config(str(copy))["seed"] == 3


def test_save_of_an_existing_step_is_a_no_op(saved):
  workdir, tx, states = saved
  params, opt_state = states[3]
  ckpt = Checkpointer(workdir / "checkpoints", keep=2)
  try:
    zeros = jax.tree.map(jnp.zeros_like, params)
    ckpt.save(3, zeros, opt_state, meta={"step": 0, "position": 0}, config={})
    ckpt.wait()
  finally:
    ckpt.close()
  restored, config, _ = load_params(str(workdir))
  _assert_tree_equal(restored, jax.tree.map(np.asarray, params))
  assert config == dict(CONFIG, seed=3)


def test_should_save_every_n_steps(tmp_path):
  ckpt = Checkpointer(tmp_path / "a", keep=1, every_steps=5)
  never = Checkpointer(tmp_path / "b", keep=1, every_steps=0)
  try:
    assert [s for s in range(1, 16) if ckpt.should_save(s)] == [5, 10, 15]
    assert not any(never.should_save(s) for s in range(1, 16))
    assert ckpt.latest_step() is None
  finally:
    ckpt.close()
    never.close()
