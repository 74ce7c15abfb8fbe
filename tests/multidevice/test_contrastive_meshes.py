"""Contrastive image-text training (objective=contrastive) on meshes of 8 (fake CPU) devices: the
same losses, parameters and embeddings as on one device, with a V-MoE image tower under expert
parallelism and HET-XL's noise on both towers' representations (its draws are sharded with the
batch and must not depend on the sharding); and `vmoe pretrain objective=contrastive sharding=ep`
end to end, whose checkpoint `vmoe eval` classifies zero-shot and retrieves with on an
expert-parallel mesh as on a data-parallel one.

Runs in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/integration/test_multidevice.py starts it); skipped anywhere else.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from conftest import QUIET, TINY_MODEL, TINY_TEXT

pytestmark = pytest.mark.skipif(jax.device_count() != 8,
                                reason="needs 8 devices (run via test_multidevice.py)")

BATCH, STEPS, SHAPE, LENGTH = 64, 3, (16, 16, 3), 12
VOCAB = 256 + 3  # the bytes tokenizer's


def _batches():
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    lengths = rng.integers(2, LENGTH + 1, BATCH)
    tokens = rng.integers(3, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    tokens[np.arange(LENGTH)[None] >= lengths[:, None]] = 0  # padding
    tokens[np.arange(BATCH), lengths - 1] = 1  # the end-of-text id, pooled at
    out.append({"image": rng.standard_normal((BATCH,) + SHAPE).astype(np.float32),
                "tokens": tokens})
  return out


def _model():
  """vmoe_tiny at TINY_MODEL's size (8 experts on block 1 of 2, width 32, 16 px) with HET-XL
  noise (R = 15, 2 samples), and a text tower of one block of width 32."""
  from runner.config.schema import HeadConfig, HeadType, ObjectiveConfig, Objective, TextConfig
  from runner.models import model_config
  from runner.models.contrastive import build_two_towers
  model = dataclasses.replace(
      model_config("vmoe_tiny"), num_layers=2, hidden_size=32, mlp_dim=64, num_heads=2,
      image_size=16, head=HeadConfig(type=HeadType.het_xl, num_factors=15,
                                     parameter_efficient=False, train_mc_samples=2))
  text = TextConfig(width=32, depth=1, mlp_dim=64, num_heads=2, max_length=LENGTH)
  objective = ObjectiveConfig(name=Objective.contrastive, embedding_dim=16)
  return build_two_towers(model, text, objective, VOCAB)


def _train(placement, workdir):
  """STEPS contrastive train steps on `placement`: (losses, temperatures, final params, the
  evaluation embeddings of the first batch, the compiled step's text)."""
  from runner.checkpoints.checkpoint import Checkpointer
  from runner.train import objectives, optimizers, schedules, state as state_lib
  from runner.train.start import initial_state
  from runner.train.step import make_train_step
  model = _model()
  schedule = schedules.make_schedule("linear", 1e-3, 100, 2)
  abstract, _ = state_lib.abstract_params(model, SHAPE)
  tx = optimizers.make_optimizer("adam", schedule, abstract, weight_decay=0.1, grad_clip_norm=1.0)
  objective = objectives.contrastive_pairs(model, loss="softmax", aux_loss_weight=0.01)
  with placement.context():
    state, shardings, _, _ = initial_state(Checkpointer(workdir), model=model, tx=tx,
                                           image_shape=SHAPE, placement=placement, seed=0)
    step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01,
                                   objective=objective),
                   in_shardings=(shardings, placement.batch_sharding),
                   out_shardings=(shardings, None))
    text = step.lower(state, placement.put(_batches()[0])).compile().as_text()
    losses, temperatures = [], []
    for batch in _batches():
      state, metrics = step(state, placement.put(batch))
      losses.append(float(metrics["train/loss"]))
      temperatures.append(float(metrics["train/temperature"]))

    def embed(params, batch):
      zimg, extras = model.apply({"params": params}, batch["image"], batch["tokens"], train=False)
      return {"image": zimg, "text": extras["text_embedding"]}
    embeddings = jax.tree.map(np.asarray, jax.jit(embed)(state.params,
                                                         placement.put(_batches()[0])))
  return losses, temperatures, jax.tree.map(np.asarray, state.params), embeddings, text


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  from runner.parallel import Placement, RULES, make_mesh
  placement = Placement(make_mesh(1, 1, devices=jax.devices()[:1]), RULES["dp"])
  return _train(placement, tmp_path_factory.mktemp("one"))


# 1 x 8 is the check; 4 x 2 (data and expert axes together) in make test-full.
@pytest.mark.parametrize("data, expert", [(1, 8), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_contrastive_training_under_expert_parallelism_matches_one_device(data, expert,
                                                                         one_device, tmp_path):
  from runner.parallel import logical_rules, placement as make_placement
  ref_losses, ref_temperatures, ref_params, ref_embeddings, _ = one_device
  assert np.all(np.isfinite(ref_losses)) and ref_temperatures[0] == pytest.approx(3.0)
  placement = make_placement(data, expert, logical_rules("ep"), num_experts=8)
  losses, temperatures, params, embeddings, text = _train(placement, tmp_path)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
  np.testing.assert_allclose(temperatures, ref_temperatures, rtol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree.leaves(ref_params)):
    name = jax.tree_util.keystr(path)
    if name.endswith("['qkv_bias']"):
      # The attention key bias (qkv_bias[1]) has an exactly-zero gradient: Adam turns float
      # noise into updates of up to the learning rate there (as in test_meshes.py).
      np.testing.assert_allclose(a[1], b[1], atol=STEPS * 1e-3, err_msg=name)
      a, b = np.delete(a, 1, axis=0), np.delete(b, 1, axis=0)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
  for key, value in embeddings.items():
    np.testing.assert_allclose(value, ref_embeddings[key], rtol=1e-4, atol=1e-5, err_msg=key)
  assert "all-to-all" in text  # the image tower's tokens travel to their experts' devices
  kernel = params["image"]["block_1"]["moe"]["experts"]["fc1_kernel"]
  assert kernel.shape[0] == 8


def test_cli_contrastive_pretrain_expert_parallel_then_zero_shot_eval(run_cli, tmp_path):
  """`vmoe pretrain objective=contrastive sharding=ep` end to end on 8 devices (HET-XL noise, a
  V-MoE image tower): training, validation with zero-shot accuracy, the checkpoint; then
  `vmoe eval` of it (zero-shot classification and retrieval) on a data-parallel and on an
  expert-parallel mesh gives the same numbers."""
  run = tmp_path / "run"
  code, _, err = run_cli("pretrain", f"workdir={run}", "objective=contrastive", *TINY_MODEL,
                         *QUIET, *TINY_TEXT, "model.head.type=het_xl", "sharding=ep",
                         "train.steps=2", "schedule.warmup_steps=0",
                         "train.log_every_steps=1", "data.batch_size=64",
                         'data.eval_split="validation[:64]"', "data.test_split=null")
  assert code == 0, err
  config = __import__("yaml").safe_load((run / "config.yaml").read_text())
  assert config["sharding"]["name"] == "ep" and config["mesh"]["expert"] == -1
  lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["train/loss"] for r in lines if "train/loss" in r}
  assert sorted(losses) == [1, 2] and np.all(np.isfinite(list(losses.values())))
  summary = json.loads((run / "summary.json").read_text())
  assert np.isfinite(summary["val/loss"]) and 0 <= summary["val/zero_shot_prec@1"] <= 1
  assert (run / "checkpoints" / "2").is_dir()
  summaries = []
  for name, args in (("dp", ["mesh.data=8"]), ("ep", ["sharding=ep"])):
    code, _, err = run_cli("eval", f"init.checkpoint={run}", f"workdir={tmp_path / name}",
                           *QUIET, *args, 'eval.split="test[:128]"', "eval.retrieval=true",
                           "data.batch_size=64")
    assert code == 0, err
    summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
  dp, ep = summaries
  # Measured, not computed: speed, and XLA's FLOP count (it counts the all-to-alls too).
  keys = sorted(k for k, v in ep.items() if isinstance(v, float) and "images_per_s" not in k
                and "seconds" not in k and not k.startswith("compute/"))
  recalls = [k for k in keys if "recall@" in k]
  assert any(k.endswith("/prec@1") for k in keys) and len(recalls) == 6, keys
  for key in keys:
    # Two steps on captions that carry only the label: many pairs' similarities are near-ties,
    # which float rounding may order differently (a retrieval query more or less among 128).
    tolerance = 2 / 128 if key in recalls else 1e-6
    assert ep[key] == pytest.approx(dp[key], rel=1e-4, abs=tolerance), key
