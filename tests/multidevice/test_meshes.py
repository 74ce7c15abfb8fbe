"""Training on meshes of 8 (fake CPU) devices matches one device; shardings are what they claim.

Runs in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/integration/test_multidevice.py starts it); skipped anywhere else.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from runner.checkpoint import Checkpointer
from runner.models import build_model, model_config
from runner.parallel import Placement, RULES, logical_rules, make_mesh, placement as make_placement
from runner.train import optimizers, schedules, state as state_lib
from runner.train.loop import initial_state
from runner.train.step import make_train_step

pytestmark = pytest.mark.skipif(jax.device_count() != 8,
                                reason="needs 8 devices (run via test_multidevice.py)")

BATCH, STEPS, SHAPE = 64, 3, (32, 32, 3)
MESHES = {  # name: (mesh.data, mesh.expert, sharding.name), as a task's config gives them
    "8 data": (8, 1, "dp"),
    "4 data x 2 expert": (4, 2, "ep"),
    "1 data x 8 expert": (1, 8, "ep"),
    "2 data x 4 expert, fsdp": (2, 4, "fsdp_ep"),
}


def _batches():
  rng = np.random.default_rng(0)
  return [{"image": rng.standard_normal((BATCH,) + SHAPE).astype(np.float32),
           "labels": np.eye(10, dtype=np.float32)[rng.integers(0, 10, BATCH)]}
          for _ in range(STEPS)]


def _train(placement, workdir):
  """STEPS train steps of vmoe_tiny (no dropout) on `placement`; (losses, final state)."""
  model = build_model(model_config("vmoe_tiny"), 10)
  schedule = schedules.make_schedule("linear", 1e-3, 100, 2)
  abstract, _ = state_lib.abstract_params(model, SHAPE)
  tx = optimizers.make_optimizer("adam", schedule, abstract, weight_decay=0.1, grad_clip_norm=1.0)
  with placement.context():
    state, shardings, _, _ = initial_state(Checkpointer(workdir), model=model, tx=tx,
                                           image_shape=SHAPE, placement=placement, seed=0)
    step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01),
                   in_shardings=(shardings, placement.batch_sharding),
                   out_shardings=(shardings, None))
    losses = []
    _train.compiled_text = step.lower(state, placement.put(_batches()[0])).compile().as_text()
    for batch in _batches():
      state, metrics = step(state, placement.put(batch))
      losses.append(float(metrics["train/loss"]))
  return losses, state


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
  placement = Placement(make_mesh(1, 1, devices=jax.devices()[:1]), RULES["dp"])
  return _train(placement, tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("name", list(MESHES))
def test_training_on_a_mesh_matches_one_device(name, single_device, tmp_path):
  data, expert, bundle = MESHES[name]
  placement = make_placement(data, expert, logical_rules(bundle), num_experts=8)
  assert placement.mesh.devices.shape == (data, expert) and placement.rules == RULES[bundle]
  losses, state = _train(placement, tmp_path)
  ref_losses, ref_state = single_device
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                          jax.tree.leaves(ref_state.params)):
    # atol: the attention key bias has an exactly-zero gradient, so Adam turns float noise into
    # updates of up to ~1e-6 there; everything else agrees to float32 rounding.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  if expert == 1:
    assert "all-to-all" not in _train.compiled_text
  if expert > 1:
    kernel = state.params["block_1"]["moe"]["experts"]["fc1_kernel"]  # (E=8, 128, 512)
    expected = P("expert", "data", None) if "fsdp" in name else P("expert", None, None)
    assert kernel.sharding.spec == expected
    shard_shape = (8 // expert, 128 // (data if "fsdp" in name else 1), 512)
    assert {s.data.shape for s in kernel.addressable_shards} == {shard_shape}
    assert "all-to-all" in _train.compiled_text  # tokens travel to the devices of their experts
    router = state.params["block_1"]["moe"]["router"]["dense"]["kernel"]
    assert router.sharding.spec in (P(), P(None, None), P("data", None))


def test_save_on_8_devices_restore_on_1_and_on_2x4(tmp_path):
  placement = Placement(make_mesh(8, 1), RULES["dp"])
  _, state = _train(placement, tmp_path / "unused")
  checkpointer = Checkpointer(tmp_path / "ckpt", async_save=False)
  checkpointer.save(3, state.params, state.opt_state, meta={"position": 0}, config={})
  checkpointer.wait()
  model = build_model(model_config("vmoe_tiny"), 10)
  abstract, logical = state_lib.abstract_params(model, SHAPE)
  tx = optimizers.make_optimizer("adam", lambda s: 1e-3, abstract)
  for target in (Placement(make_mesh(1, 1, devices=jax.devices()[:1]), RULES["dp"]),
                 Placement(make_mesh(2, 4), RULES["ep"])):
    shardings = target.shardings(logical)
    with_sharding = lambda tree, sh: jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sh)
    opt_abstract = jax.eval_shape(tx.init, abstract)
    opt_shardings = jax.tree.map(lambda _: jax.sharding.NamedSharding(target.mesh, P()),
                                 opt_abstract)
    params, opt_state, _ = Checkpointer(tmp_path / "ckpt").restore(
        3, with_sharding(abstract, shardings), with_sharding(opt_abstract, opt_shardings))
    kernel = params["block_1"]["moe"]["experts"]["fc1_kernel"]
    assert kernel.sharding.mesh.devices.shape == target.mesh.devices.shape
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(state.opt_state)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
