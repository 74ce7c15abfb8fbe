"""Training on meshes of 8 (fake CPU) devices matches one device; shardings are what they claim.

For a V-MoE and for a partitioned batch ensemble (E³), whose members' tokens travel to the devices
of their partition's experts under expert parallelism.

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
from runner.loop import initial_state
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


def _train(placement, workdir, name: str = "vmoe_tiny"):
  """STEPS train steps of model `name` (no dropout) on `placement`; (losses, final state, eval
  outputs on the first batch: logits and, for an ensemble, member logits and joint features)."""
  model = build_model(model_config(name), 10)
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

    def predict(params, images):
      logits, extras = model.apply({"params": params}, images, train=False)
      return {"logits": logits, **{k: extras[k] for k in ("member_logits", "pre_logits")
                                   if k in extras}}
    images = placement.put({"image": _batches()[0]["image"]})["image"]
    outputs = jax.tree.map(np.asarray, jax.jit(predict)(state.params, images))
  return losses, state, outputs


# A V-MoE, and a partitioned batch ensemble (E³: 2 members of 4 experts, k=1) that must shard alike.
MODELS = ("vmoe_tiny", "vmoe_tiny_k1_m2")


@pytest.fixture(scope="module", params=MODELS)
def single_device(request, tmp_path_factory):
  placement = Placement(make_mesh(1, 1, devices=jax.devices()[:1]), RULES["dp"])
  return request.param, _train(placement, tmp_path_factory.mktemp("one"), request.param)


@pytest.mark.parametrize("name", list(MESHES))
def test_training_on_a_mesh_matches_one_device(name, single_device, tmp_path):
  model_name, (ref_losses, ref_state, ref_outputs) = single_device
  data, expert, bundle = MESHES[name]
  placement = make_placement(data, expert, logical_rules(bundle), num_experts=8)
  assert placement.mesh.devices.shape == (data, expert) and placement.rules == RULES[bundle]
  losses, state, outputs = _train(placement, tmp_path, model_name)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                          jax.tree.leaves(ref_state.params)):
    # atol: the attention key bias has an exactly-zero gradient, so Adam turns float noise into
    # updates of up to ~1e-6 there; everything else agrees to float32 rounding.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  for key, value in outputs.items():  # the prediction (an ensemble's: every member's too)
    np.testing.assert_allclose(value, ref_outputs[key], rtol=1e-4, atol=1e-5, err_msg=key)
  if model_name != "vmoe_tiny":
    members = outputs["member_logits"]
    assert members.shape == (BATCH, 2, 10) and np.abs(members[:, 0] - members[:, 1]).max() > 1e-4
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


@pytest.mark.parametrize("model_name", ["ecmoe_tiny", "softmoe_tiny"])
def test_every_router_family_trains_on_a_mesh_as_on_one_device(model_name, tmp_path):
  """Experts-choice and Soft MoE routers: the same losses, parameters and predictions on 8
  data-parallel devices and under expert parallelism over 8 devices (Soft MoE's slots live with
  their experts: its slot parameters mu are sharded along the expert axis) as on one device."""
  one = Placement(make_mesh(1, 1, devices=jax.devices()[:1]), RULES["dp"])
  ref_losses, ref_state, ref_outputs = _train(one, tmp_path / "one", model_name)
  for data, expert, bundle in ((8, 1, "dp"), (1, 8, "ep")):
    placement = make_placement(data, expert, logical_rules(bundle), num_experts=8)
    losses, state, outputs = _train(placement, tmp_path / f"{data}x{expert}", model_name)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, err_msg=bundle)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                            jax.tree.leaves(ref_state.params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                                 err_msg=f"{bundle} {jax.tree_util.keystr(path)}")
    np.testing.assert_allclose(outputs["logits"], ref_outputs["logits"], rtol=1e-4, atol=1e-5,
                               err_msg=bundle)
    if expert > 1:
      assert "all-to-all" in _train.compiled_text
      moe = state.params["block_1"]["moe"]
      assert moe["experts"]["fc1_kernel"].sharding.spec == P("expert", None, None)
      if model_name == "softmoe_tiny":
        assert moe["router"]["mu"].sharding.spec == P(None, "expert", None)


def test_save_on_8_devices_restore_on_1_and_on_2x4(tmp_path):
  placement = Placement(make_mesh(8, 1), RULES["dp"])
  _, state, _ = _train(placement, tmp_path / "unused")
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


def test_a_het_xl_head_trains_on_a_mesh_as_on_one_device(tmp_path):
  """vmoe_tiny with a HET-XL head (learned τ, 8 MC samples): the same losses, τ and eval logits
  on 8 data-parallel devices and on a 4 x 2 expert-parallel mesh as on one device. The noise
  draws (B, S, R) are sharded with the batch and must not depend on the sharding."""
  import dataclasses

  from runner.config.schema import HeadConfig, HeadType
  from runner.models import heads

  config = dataclasses.replace(model_config("vmoe_tiny"), head=HeadConfig(
      type=HeadType.het_xl, num_factors=4, train_mc_samples=8, eval_mc_samples=8))

  def train(placement, workdir):
    model = build_model(config, 10)
    schedule = schedules.make_schedule("linear", 1e-3, 100, 2)
    abstract, _ = state_lib.abstract_params(model, SHAPE)
    tx = optimizers.make_optimizer("adam", schedule, abstract, weight_decay=0.1,
                                   grad_clip_norm=1.0)
    with placement.context():
      state, shardings, _, _ = initial_state(Checkpointer(workdir), model=model, tx=tx,
                                             image_shape=SHAPE, placement=placement, seed=0)
      step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent",
                                     aux_loss_weight=0.01),
                     in_shardings=(shardings, placement.batch_sharding),
                     out_shardings=(shardings, None))
      losses, temperatures = [], []
      for batch in _batches():
        state, metrics = step(state, placement.put(batch))
        losses.append(float(metrics["train/loss"]))
        temperatures.append(float(metrics["train/temperature"]))
      images = placement.put({"image": _batches()[0]["image"]})["image"]
      logits = np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x, train=False)[0])(
          state.params, images))
    return losses, temperatures, state, logits

  one = train(Placement(make_mesh(1, 1, devices=jax.devices()[:1]), RULES["dp"]),
              tmp_path / "one")
  t = float(one[2].params["head"]["pre_sigmoid_temperature"][0])
  assert t != 0.0 and one[1][0] == pytest.approx(2.525, abs=1e-6)  # τ was learned
  assert np.all(np.isfinite(one[3]))
  np.testing.assert_allclose(np.exp(one[3]).sum(-1), 1.0, atol=1e-5)  # log p̄
  for data, expert, bundle in ((8, 1, "dp"), (4, 2, "ep")):
    placement = make_placement(data, expert, logical_rules(bundle), num_experts=8)
    losses, temperatures, state, logits = train(placement, tmp_path / f"{data}x{expert}")
    np.testing.assert_allclose(losses, one[0], rtol=2e-5, err_msg=bundle)
    np.testing.assert_allclose(temperatures, one[1], rtol=1e-6, err_msg=bundle)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state.params["head"])[0],
                            jax.tree.leaves(one[2].params["head"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                                 err_msg=f"{bundle} head{jax.tree_util.keystr(path)}")
    np.testing.assert_allclose(logits, one[3], rtol=1e-4, atol=1e-5, err_msg=bundle)
  assert heads.num_classes(one[2].params) == 10
