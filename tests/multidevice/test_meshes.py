"""Training on meshes of 8 (fake CPU) devices matches one device; shardings are what they claim.

For a V-MoE and for a partitioned batch ensemble (E³), whose members' tokens travel to the devices
of their partition's experts under expert parallelism; for the experts-choice and Soft MoE router
families; for DeepSeekMoE's shared and fine-grained experts; for auxiliary-loss-free balancing's
bias; and for a HET-XL head. Every model is the catalog's at the suite's tiny size
(tests/conftest.py's TINY_MODEL): it keeps its 8 experts on block 1, its router and its members.

Runs in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/integration/test_multidevice.py starts it); skipped anywhere else.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import TINY_MODEL
from runner.checkpoints.checkpoint import Checkpointer
from runner.config.schema import HeadConfig, HeadType
from runner.models import build_model, heads, model_config, param_updates_of
from runner.models.moe.routers.token_choice import Balance
from runner.parallel import Placement, RULES, logical_rules, make_mesh, placement as make_placement
from runner.train import optimizers, schedules, state as state_lib
from runner.train.start import initial_state
from runner.train.step import make_train_step

pytestmark = pytest.mark.skipif(jax.device_count() != 8,
                                reason="needs 8 devices (run via test_multidevice.py)")

# TINY_MODEL's sizes (2 blocks, width 32, MLP 64, 2 heads, 16 px): what compiles and trains fast.
TINY = {arg.split("=")[0].removeprefix("model."): int(arg.split("=")[1]) for arg in TINY_MODEL}
BATCH, STEPS, SHAPE = 64, 3, (TINY["image_size"], TINY["image_size"], 3)
MESHES = {  # name: (mesh.data, mesh.expert, sharding.name), as a task's config gives them
    "8 data": (8, 1, "dp"),
    "4 data x 2 expert": (4, 2, "ep"),
    "1 data x 8 expert": (1, 8, "ep"),
    "2 data x 4 expert, fsdp": (2, 4, "fsdp_ep"),
}
ONE_DEVICE = "1 device"


def _tiny(name: str, **changes):
  """Catalog model `name` at TINY's size."""
  return dataclasses.replace(model_config(name), **TINY, **changes)


MODELS = {
    "vmoe_tiny": _tiny("vmoe_tiny"),
    "vmoe_tiny_k1_m2": _tiny("vmoe_tiny_k1_m2"),  # E³: 2 members of 4 experts, k=1
    "ecmoe_tiny": _tiny("ecmoe_tiny"),
    "softmoe_tiny": _tiny("softmoe_tiny"),
    # DeepSeekMoE: 16 fine-grained experts of width 32 (4 chosen) and a shared expert.
    "vmoe_tiny_s1_f2": _tiny("vmoe_tiny_s1_f2"),
    # Auxiliary-loss-free balancing: a per-expert bias moved by 0.01 a step from the batch's loads.
    "vmoe_tiny_bias": _tiny("vmoe_tiny", router=dataclasses.replace(
        model_config("vmoe_tiny").router, balance=Balance.bias, bias_update_rate=0.01)),
    # HET-XL head (learned τ, 8 MC samples): its noise draws (B, S, R) are sharded with the batch.
    "vmoe_tiny_het_xl": _tiny("vmoe_tiny", head=HeadConfig(
        type=HeadType.het_xl, num_factors=4, train_mc_samples=8, eval_mc_samples=8)),
}


class Training(NamedTuple):
  losses: list[float]
  temperatures: list[float]  # HET-XL's τ each step; empty for other heads
  state: state_lib.TrainState
  outputs: dict[str, np.ndarray]  # on the first batch: logits (an ensemble's: member logits too)
  compiled_text: str  # the compiled train step


def _batches():
  rng = np.random.default_rng(0)
  return [{"image": rng.standard_normal((BATCH,) + SHAPE).astype(np.float32),
           "labels": np.eye(10, dtype=np.float32)[rng.integers(0, 10, BATCH)]}
          for _ in range(STEPS)]


def _placement(mesh: str) -> Placement:
  if mesh == ONE_DEVICE:
    return Placement(make_mesh(1, 1, devices=jax.devices()[:1]), RULES["dp"])
  data, expert, bundle = MESHES[mesh]
  placement = make_placement(data, expert, logical_rules(bundle), num_experts=8)
  assert placement.mesh.devices.shape == (data, expert) and placement.rules == RULES[bundle]
  return placement


def _train(placement: Placement, workdir, config) -> Training:
  """STEPS train steps of the model `config` (no dropout) on `placement`."""
  model = build_model(config, 10)
  schedule = schedules.make_schedule("linear", 1e-3, 100, 2)
  abstract, _ = state_lib.abstract_params(model, SHAPE)
  tx = optimizers.make_optimizer("adam", schedule, abstract, weight_decay=0.1, grad_clip_norm=1.0)
  with placement.context():
    state, shardings, _, _ = initial_state(Checkpointer(workdir), model=model, tx=tx,
                                           image_shape=SHAPE, placement=placement, seed=0)
    step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01,
                                   param_updates=param_updates_of(config, "pretrain")),
                   in_shardings=(shardings, placement.batch_sharding),
                   out_shardings=(shardings, None))
    compiled_text = step.lower(state, placement.put(_batches()[0])).compile().as_text()
    losses, temperatures = [], []
    for batch in _batches():
      state, metrics = step(state, placement.put(batch))
      losses.append(float(metrics["train/loss"]))
      if "train/temperature" in metrics:
        temperatures.append(float(metrics["train/temperature"]))

    def predict(params, images):
      logits, extras = model.apply({"params": params}, images, train=False)
      return {"logits": logits, **{k: extras[k] for k in ("member_logits", "pre_logits")
                                   if k in extras}}
    images = placement.put({"image": _batches()[0]["image"]})["image"]
    outputs = jax.tree.map(np.asarray, jax.jit(predict)(state.params, images))
  return Training(losses, temperatures, state, outputs, compiled_text)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """trained(model, mesh): the Training of MODELS[model] on mesh (a MESHES name or ONE_DEVICE),
  trained once per module: a one-device reference serves every mesh it is compared with."""
  done = {}

  def train(model: str, mesh: str) -> Training:
    if (model, mesh) not in done:
      done[model, mesh] = _train(_placement(mesh), tmp_path_factory.mktemp("train"),
                                 MODELS[model])
    return done[model, mesh]
  return train


def _assert_params_match(params, ref_params, context: str = ""):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree.leaves(ref_params)):
    # atol: the attention key bias has an exactly-zero gradient, so Adam turns float noise into
    # updates of a few 1e-6 there (at most 2e-6 measured); everything else agrees to float32
    # rounding.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                               err_msg=f"{context} {jax.tree_util.keystr(path)}")


# The V-MoE on every mesh; the E³ ensemble where its members' tokens cross devices to reach their
# partition's experts (its data-parallel and FSDP placements are the V-MoE's).
PAIRS = [*(("vmoe_tiny", name) for name in MESHES),
         *(("vmoe_tiny_k1_m2", name) for name in ("4 data x 2 expert", "1 data x 8 expert"))]


@pytest.mark.parametrize("model_name, name", PAIRS)
def test_training_on_a_mesh_matches_one_device(model_name, name, trained):
  ref = trained(model_name, ONE_DEVICE)
  got = trained(model_name, name)
  data, expert, _ = MESHES[name]
  np.testing.assert_allclose(got.losses, ref.losses, rtol=2e-5)
  _assert_params_match(got.state.params, ref.state.params)
  for key, value in got.outputs.items():  # the prediction (an ensemble's: every member's too)
    np.testing.assert_allclose(value, ref.outputs[key], rtol=1e-4, atol=1e-5, err_msg=key)
  if model_name != "vmoe_tiny":
    members = got.outputs["member_logits"]
    assert members.shape == (BATCH, 2, 10) and np.abs(members[:, 0] - members[:, 1]).max() > 1e-4
  if expert == 1:
    assert "all-to-all" not in got.compiled_text
  if expert > 1:
    kernel = got.state.params["block_1"]["moe"]["experts"]["fc1_kernel"]  # (E=8, 32, 64)
    hidden, mlp = TINY["hidden_size"], TINY["mlp_dim"]
    assert kernel.shape == (8, hidden, mlp)
    expected = P("expert", "data", None) if "fsdp" in name else P("expert", None, None)
    assert kernel.sharding.spec == expected
    shard_shape = (8 // expert, hidden // (data if "fsdp" in name else 1), mlp)
    assert {s.data.shape for s in kernel.addressable_shards} == {shard_shape}
    assert "all-to-all" in got.compiled_text  # tokens travel to the devices of their experts
    router = got.state.params["block_1"]["moe"]["router"]["dense"]["kernel"]
    assert router.sharding.spec in (P(), P(None, None), P("data", None))


@pytest.mark.parametrize("model_name", ["ecmoe_tiny", "softmoe_tiny"])
def test_every_router_family_trains_on_a_mesh_as_on_one_device(model_name, trained):
  """Experts-choice and Soft MoE routers: the same losses, parameters and predictions on 8
  data-parallel devices and under expert parallelism over 8 devices (Soft MoE's slots live with
  their experts: its slot parameters mu are sharded along the expert axis) as on one device."""
  ref = trained(model_name, ONE_DEVICE)
  for name in ("8 data", "1 data x 8 expert"):
    got = trained(model_name, name)
    np.testing.assert_allclose(got.losses, ref.losses, rtol=2e-5, err_msg=name)
    _assert_params_match(got.state.params, ref.state.params, name)
    np.testing.assert_allclose(got.outputs["logits"], ref.outputs["logits"], rtol=1e-4,
                               atol=1e-5, err_msg=name)
    if MESHES[name][1] > 1:
      assert "all-to-all" in got.compiled_text
      moe = got.state.params["block_1"]["moe"]
      assert moe["experts"]["fc1_kernel"].sharding.spec == P("expert", None, None)
      if model_name == "softmoe_tiny":
        assert moe["router"]["mu"].sharding.spec == P(None, "expert", None)


def test_shared_and_fine_grained_experts_train_on_a_mesh_as_on_one_device(trained):
  """Under expert parallelism the E*m fine-grained experts are split over the expert axis and
  the shared expert, which every token passes through, is replicated: the same losses,
  parameters and predictions as on one device."""
  ref = trained("vmoe_tiny_s1_f2", ONE_DEVICE)
  got = trained("vmoe_tiny_s1_f2", "1 data x 8 expert")
  np.testing.assert_allclose(got.losses, ref.losses, rtol=2e-5)
  _assert_params_match(got.state.params, ref.state.params)
  np.testing.assert_allclose(got.outputs["logits"], ref.outputs["logits"], rtol=1e-4, atol=1e-5)
  moe = got.state.params["block_1"]["moe"]
  hidden, width = TINY["hidden_size"], TINY["mlp_dim"] // 2
  assert moe["experts"]["fc1_kernel"].shape == (16, hidden, width)
  assert moe["experts"]["fc1_kernel"].sharding.spec == P("expert", None, None)
  assert moe["shared"]["fc1_kernel"].shape == (1, hidden, width)
  assert all(axis is None for axis in moe["shared"]["fc1_kernel"].sharding.spec)
  assert "all-to-all" in got.compiled_text


def test_the_balance_bias_is_global_under_expert_parallelism(trained):
  """The loads that move the bias count every routing group of every device: under expert
  parallelism over 8 devices the bias after 3 steps is the one-device run's, and it is whole on
  every device."""
  ref = trained("vmoe_tiny_bias", ONE_DEVICE)
  got = trained("vmoe_tiny_bias", "1 data x 8 expert")
  bias = got.state.params["block_1"]["moe"]["router"]["balance_bias"]
  want = np.asarray(ref.state.params["block_1"]["moe"]["router"]["balance_bias"])
  assert np.abs(want).max() > 0
  np.testing.assert_allclose(np.asarray(bias), want, rtol=0, atol=1e-4)
  assert all(axis is None for axis in bias.sharding.spec)
  assert {s.data.shape for s in bias.addressable_shards} == {(8,)}
  np.testing.assert_allclose(got.losses, ref.losses, rtol=2e-5)
  _assert_params_match(got.state.params, ref.state.params)


def test_save_on_8_devices_restore_on_1_and_on_2x4(trained, tmp_path):
  state = trained("vmoe_tiny", "8 data").state
  checkpointer = Checkpointer(tmp_path / "ckpt", async_save=False)
  checkpointer.save(3, state.params, state.opt_state, meta={"position": 0}, config={})
  checkpointer.wait()
  model = build_model(MODELS["vmoe_tiny"], 10)
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


def test_a_het_xl_head_trains_on_a_mesh_as_on_one_device(trained):
  """A V-MoE with a HET-XL head (learned τ, 8 MC samples): the same losses, τ and eval logits
  on 8 data-parallel devices and on a 4 x 2 expert-parallel mesh as on one device. The noise
  draws (B, S, R) are sharded with the batch and must not depend on the sharding."""
  one = trained("vmoe_tiny_het_xl", ONE_DEVICE)
  t = float(one.state.params["head"]["pre_sigmoid_temperature"][0])
  assert t != 0.0 and one.temperatures[0] == pytest.approx(2.525, abs=1e-6)  # τ was learned
  assert np.all(np.isfinite(one.outputs["logits"]))
  np.testing.assert_allclose(np.exp(one.outputs["logits"]).sum(-1), 1.0, atol=1e-5)  # log p̄
  for name in ("8 data", "4 data x 2 expert"):
    got = trained("vmoe_tiny_het_xl", name)
    np.testing.assert_allclose(got.losses, one.losses, rtol=2e-5, err_msg=name)
    np.testing.assert_allclose(got.temperatures, one.temperatures, rtol=1e-6, err_msg=name)
    _assert_params_match(got.state.params["head"], one.state.params["head"], f"{name} head")
    np.testing.assert_allclose(got.outputs["logits"], one.outputs["logits"], rtol=1e-4,
                               atol=1e-5, err_msg=name)
  assert heads.num_classes(one.state.params) == 10
