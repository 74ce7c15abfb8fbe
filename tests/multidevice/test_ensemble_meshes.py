"""A partitioned batch ensemble (E³) on meshes of 8 (fake CPU) devices matches one device.

Expert parallelism moves each member's tokens to the devices of its partition's experts; the
losses, the parameters after a few steps and the evaluation logits must not notice. Runs in its
own process with XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/integration/test_multidevice.py starts it); skipped anywhere else.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import PartitionSpec as P

from conftest import QUIET, TINY_MODEL
from runner.checkpoint import Checkpointer
from runner.models import build_model, model_config
from runner.parallel import Placement, RULES, logical_rules, make_mesh, placement as make_placement
from runner.train import optimizers, schedules, state as state_lib
from runner.train.loop import initial_state
from runner.train.step import make_train_step

pytestmark = pytest.mark.skipif(jax.device_count() != 8,
                                reason="needs 8 devices (run via test_multidevice.py)")

# vmoe_tiny with k=1 and M=2: 8 experts, two partitions of 4, one MoE layer (block 1).
MODEL = "vmoe_tiny_k1_m2"
BATCH, STEPS, SHAPE = 64, 3, (32, 32, 3)
MESHES = {  # name: (mesh.data, mesh.expert, sharding.name)
    "8 data": (8, 1, "dp"),
    "4 data x 2 expert": (4, 2, "ep"),
    "1 data x 8 expert": (1, 8, "ep"),
}


def _model():
  config = model_config(MODEL)
  assert config.moe.ensemble_size == 2 and config.router.k == 1 and config.moe.num_experts == 8
  return build_model(config, 10)


def _batches():
  rng = np.random.default_rng(0)
  return [{"image": rng.standard_normal((BATCH,) + SHAPE).astype(np.float32),
           "labels": np.eye(10, dtype=np.float32)[rng.integers(0, 10, BATCH)]}
          for _ in range(STEPS)]


def _train(placement, workdir):
  """STEPS train steps of the pBE on `placement`; (losses, final state, eval logits)."""
  model = _model()
  schedule = schedules.make_schedule("linear", 1e-3, 100, 2)
  abstract, _ = state_lib.abstract_params(model, SHAPE)
  tx = optimizers.make_optimizer("adam", schedule, abstract, weight_decay=0.1, grad_clip_norm=1.0)
  with placement.context():
    state, shardings, _, _ = initial_state(Checkpointer(workdir), model=model, tx=tx,
                                           image_shape=SHAPE, placement=placement, seed=0)
    step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01),
                   in_shardings=(shardings, placement.batch_sharding),
                   out_shardings=(shardings, None))
    compiled = step.lower(state, placement.put(_batches()[0])).compile().as_text()
    losses = []
    for batch in _batches():
      state, metrics = step(state, placement.put(batch))
      losses.append(float(metrics["train/loss"]))

    def predict(params, images):
      logits, extras = model.apply({"params": params}, images, train=False)
      return logits, extras["member_logits"], extras["pre_logits"]

    images = placement.put({"image": _batches()[0]["image"]})["image"]
    logits = jax.tree.map(np.asarray, jax.jit(predict)(state.params, images))
  return losses, state, logits, compiled


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
  placement = Placement(make_mesh(1, 1, devices=jax.devices()[:1]), RULES["dp"])
  return _train(placement, tmp_path_factory.mktemp("pbe_one"))


@pytest.mark.parametrize("name", list(MESHES))
def test_pbe_training_on_a_mesh_matches_one_device(name, single_device, tmp_path):
  data, expert, bundle = MESHES[name]
  placement = make_placement(data, expert, logical_rules(bundle), num_experts=8)
  assert placement.mesh.devices.shape == (data, expert)
  losses, state, (logits, members, features), compiled = _train(placement, tmp_path)
  ref_losses, ref_state, (ref_logits, ref_members, ref_features), _ = single_device
  assert np.all(np.isfinite(losses))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                          jax.tree.leaves(ref_state.params)):
    # As test_meshes.py: the attention key bias has an exactly-zero gradient, so Adam turns float
    # noise into updates of up to ~1e-6 there; everything else agrees to float32 rounding.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  # Evaluation: the ensemble's prediction, every member's and the joint features.
  assert logits.shape == (BATCH, 10) and members.shape == (BATCH, 2, 10)
  assert features.shape[0] == BATCH
  np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(members, ref_members, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(features, ref_features, rtol=1e-4, atol=1e-5)
  # The two members really differ (different experts), on every mesh as on one device.
  assert np.abs(members[:, 0] - members[:, 1]).max() > 1e-4
  if expert > 1:
    kernel = state.params["block_1"]["moe"]["experts"]["fc1_kernel"]  # (E=8, 128, 512)
    assert kernel.sharding.spec == P("expert", None, None)
    assert {s.data.shape for s in kernel.addressable_shards} == {(8 // expert, 128, 512)}
    assert "all-to-all" in compiled
  else:
    assert "all-to-all" not in compiled


FAST = [*TINY_MODEL, *QUIET, "train.steps=2", "data.batch_size=64"]


def test_pbe_cli_pretrain_expert_parallel_then_evaluate(run_cli, tmp_path):
  code, _, err = run_cli("pretrain", f"workdir={tmp_path / 'up'}", f"model={MODEL}", *FAST,
                         "sharding=ep")
  assert code == 0, err
  config = yaml.safe_load((tmp_path / "up" / "config.yaml").read_text())
  assert config["sharding"]["name"] == "ep" and config["mesh"]["expert"] == -1
  assert config["model"]["moe"]["ensemble_size"] == 2
  metrics = (tmp_path / "up" / "metrics.jsonl").read_text().splitlines()
  lines = [json.loads(line) for line in metrics]
  assert all(np.isfinite(r["train/loss"]) for r in lines if "train/loss" in r)
  # The expert-parallel checkpoint evaluated on a data-parallel mesh and on an expert one: the same
  # numbers (same batches, same groups).
  summaries = []
  for name, args in (("dp", ["mesh.data=8"]), ("ep", ["sharding=ep"])):
    code, _, err = run_cli("eval", f"init.checkpoint={tmp_path / 'up'}",
                           f"workdir={tmp_path / name}", *QUIET, *args)
    assert code == 0, err
    summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
  dp, ep = summaries
  assert ep["ensemble/size"] == 2
  for key in ("mnist5k/prec@1", "mnist5k/nll", "mnist5k/member_0/nll", "mnist5k/member_1/nll",
              "mnist5k/diversity/kl"):
    assert ep[key] == pytest.approx(dp[key], rel=1e-5, abs=1e-7), key
  code, _, err = run_cli("ensemble", f"init.checkpoint=[{tmp_path / 'up'}]",
                         f"workdir={tmp_path / 'ens'}", *QUIET, "sharding=ep")
  assert code == 0, err
  s = json.loads((tmp_path / "ens" / "summary.json").read_text())
  assert s["ensemble/type"] == "pbe" and s["ensemble/size"] == 2
  assert s["mnist5k/nll"] == pytest.approx(ep["mnist5k/nll"], rel=1e-6)
