"""Classification statistics of an eval pass against scikit-learn, streamed in uneven batches."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from sklearn.metrics import accuracy_score, brier_score_loss, log_loss

from runner.config import from_dict
from runner.config.derived import num_experts
from runner.config.schema import ModelConfig
from runner.evaluators import predictions
from runner.models import build_model, size
from runner.train import state as state_lib


def _problem(n=157, c=7, seed=0, scale=3.0):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(n, c)) * scale
  y = rng.integers(0, c, n)
  return logits, y, np.eye(c)[y]


def _stream(stats, logits, labels, sizes, pad=3):
  """Feeds the rows in batches of `sizes`, each with `pad` padded garbage rows appended."""
  start = 0
  for size in sizes:
    rows = slice(start, start + size)
    junk_logits = np.full((pad, logits.shape[1]), 50.0)
    junk_labels = np.zeros((pad, labels.shape[1]))
    stats.update({"logits": np.concatenate([logits[rows], junk_logits]),
                  "pre_logits": np.zeros((size + pad, 4)),
                  "labels": np.concatenate([labels[rows], junk_labels]),
                  "mask": np.arange(size + pad) < size})
    start += size
  assert start == len(logits)


def _softmax(logits):
  e = np.exp(logits - logits.max(1, keepdims=True))
  return e / e.sum(1, keepdims=True)


def test_softmax_metrics_match_sklearn():
  logits, y, onehot = _problem()
  stats = predictions.PredictionStats(ece_bins=10)
  _stream(stats, logits, onehot, [50, 1, 64, 42])
  m = stats.metrics("ds")
  probs = _softmax(logits)
  assert m["ds/count"] == len(y)
  assert m["ds/prec@1"] == pytest.approx(accuracy_score(y, probs.argmax(1)))
  assert m["ds/error"] == pytest.approx(1 - m["ds/prec@1"])
  assert m["ds/nll"] == pytest.approx(log_loss(y, probs, labels=range(7)), rel=1e-9)
  # Multi-class Brier = sum over classes of the one-vs-rest binary Brier scores.
  brier = sum(brier_score_loss(onehot[:, c], probs[:, c]) for c in range(7))
  assert m["ds/brier"] == pytest.approx(brier, rel=1e-9)
  # ECE from its definition, with 10 equal-width bins (i/10, (i+1)/10].
  conf, correct = probs.max(1), probs.argmax(1) == y
  bins = np.clip(np.ceil(conf * 10).astype(int) - 1, 0, 9)
  ece = sum(abs(correct[bins == b].mean() - conf[bins == b].mean()) * np.mean(bins == b)
            for b in range(10) if np.any(bins == b))
  assert m["ds/ece"] == pytest.approx(ece, rel=1e-9)


def test_multilabel_sigmoid_metrics():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(40, 5)) * 2
  labels = (rng.random((40, 5)) < 0.3).astype(float)
  labels[0] = 0  # an image with no label is never a hit
  stats = predictions.PredictionStats(loss_name="sigmoid_xent")
  _stream(stats, logits, labels, [40])
  m = stats.metrics("x")
  p = 1 / (1 + np.exp(-logits))
  hits = labels[np.arange(40), logits.argmax(1)] > 0
  assert m["x/prec@1"] == pytest.approx(hits.mean())
  bce = sum(log_loss(labels[:, c], p[:, c], labels=[0, 1]) for c in range(5))
  assert m["x/nll"] == pytest.approx(bce, rel=1e-9)
  assert m["x/brier"] == pytest.approx(((p - labels) ** 2).sum(1).mean(), rel=1e-9)


def test_scores_and_kept_arrays_skip_padding():
  logits, y, onehot = _problem(n=30)
  stats = predictions.PredictionStats(scores=True, keep_probs=True)
  _stream(stats, logits, onehot, [7, 23])
  scores = stats.score_arrays()
  np.testing.assert_allclose(scores["msp"], _softmax(logits).max(1), rtol=1e-12)
  np.testing.assert_allclose(scores["max_logit"], logits.max(1))
  kept = stats.kept_arrays()
  np.testing.assert_allclose(kept["probs"], _softmax(logits), rtol=1e-6)
  np.testing.assert_array_equal(kept["labels"], onehot)


def test_unlabelled_pass_only_counts():
  logits, _, onehot = _problem(n=12)
  stats = predictions.PredictionStats(scores=True, labelled=False)
  _stream(stats, logits, onehot[:, :3], [12])  # labels of another label space are ignored
  assert stats.metrics("ood") == {"ood/count": 12}
  assert len(stats.score_arrays()["entropy"]) == 12


def _tiny(moe: bool):
  cfg = {"name": "t", "image_size": 8, "patch_size": 4, "hidden_size": 16, "num_layers": 2,
         "mlp_dim": 32, "num_heads": 2, "classifier": "token",
         "moe": {"layers": [1] if moe else [], "num_experts": 4 if moe else 0, "group_size": 2},
         "router": {"k": 2, "capacity_ratio": 1.0}}
  cfg = from_dict(ModelConfig, cfg)
  model = build_model(cfg, 3)
  params, _ = state_lib.init_params(model, (8, 8, 3), 0)
  return cfg, model, params


def test_parameter_counts():
  cfg, _, params = _tiny(moe=True)
  total = size.count_params(params)
  assert total == sum(x.size for x in jax.tree_util.tree_leaves(params))
  experts = sum(x.size for x in jax.tree_util.tree_leaves(params["block_1"]["moe"]["experts"]))
  assert num_experts(cfg) == 4 and cfg.router.k == 2
  assert size.active_params(params, num_experts(cfg), cfg.router.k) == (
      total - experts + experts * 2 // 4)
  dense_cfg, _, dense = _tiny(moe=False)
  assert num_experts(dense_cfg) == 0
  assert size.active_params(dense, num_experts(dense_cfg), dense_cfg.router.k) == (
      size.count_params(dense))


def test_xla_flops_of_the_predict_step_grow_with_the_batch():
  _, model, params = _tiny(moe=True)
  step = jax.jit(predictions.make_predict_step(model))
  batch = lambda n: {"image": np.zeros((n, 8, 8, 3), np.float32),
                     "labels": np.zeros((n, 3), np.float32), "_mask": np.ones((n,), bool)}
  small, large = predictions.xla_flops(step, params, batch(2)), predictions.xla_flops(
      step, params, batch(8))
  assert small > 0 and 3.0 < large / small < 5.0


@pytest.mark.parametrize("num_batches", [1, 3])
def test_a_pass_reports_its_compiled_speed_even_in_one_batch(num_batches):
  """images/s leaves out the first batch (it includes compilation); a split that fits in one
  batch is timed on a second, compiled call instead of reporting nothing."""
  import tensorflow as tf
  calls = []

  def step(params, batch):
    calls.append(len(batch["image"]))
    return {"logits": batch["image"] @ params, "pre_logits": batch["image"]}

  images = np.ones((8 * num_batches, 4), np.float32)
  batches = tf.data.Dataset.from_tensor_slices({
      "image": images, "labels": np.eye(3, dtype=np.float32)[np.zeros(len(images), int)],
      "_mask": np.ones(len(images), bool)}).batch(8)
  stats = predictions.PredictionStats(loss_name="softmax_xent", ece_bins=5)
  rate = predictions.run_pass(step, np.ones((4, 3), np.float32), batches, stats)
  assert np.isfinite(rate) and rate > 0
  assert stats.count == 8 * num_batches  # the extra timing call feeds no statistics
  assert len(calls) == (2 if num_batches == 1 else num_batches)
