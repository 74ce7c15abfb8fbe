"""Classification losses and precision@1 against scikit-learn and NumPy references."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.metrics import log_loss

from runner.losses.classification import LOSSES, precision_at_1, sigmoid_xent, softmax_xent


def test_softmax_xent_matches_sklearn_log_loss_on_one_hot_labels():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(16, 5)) * 3
  classes = rng.integers(0, 5, size=16)
  classes[:5] = np.arange(5)  # every class present, so sklearn sees 5 labels
  labels = np.eye(5)[classes]
  got = np.asarray(softmax_xent(jnp.asarray(logits, jnp.float32), jnp.asarray(labels, jnp.float32)))
  assert got.shape == (16,)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(got.mean(), log_loss(classes, probs, labels=range(5)), rtol=1e-5)
  # Per example too: sklearn with one sample at a time.
  for i in range(4):
    want = log_loss([classes[i]], probs[i:i + 1], labels=range(5))
    assert got[i] == pytest.approx(want, rel=1e-5)


def test_softmax_xent_normalises_multi_hot_labels_and_handles_large_logits():
  logits = jnp.asarray([[1000.0, 0.0, -1000.0], [2.0, 1.0, 0.0]])
  labels = jnp.asarray([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
  got = np.asarray(softmax_xent(logits, labels))
  assert np.isfinite(got).all()
  assert got[0] == pytest.approx(0.0, abs=1e-6)
  z = np.log(np.exp([2.0, 1.0, 0.0]).sum())
  assert got[1] == pytest.approx(0.5 * (z - 2.0) + 0.5 * (z - 1.0), rel=1e-6)


def test_sigmoid_xent_matches_numpy_binary_cross_entropy():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(6, 7)) * 4
  labels = (rng.random(size=(6, 7)) < 0.3).astype(np.float64)
  got = np.asarray(sigmoid_xent(jnp.asarray(logits, jnp.float32), jnp.asarray(labels, jnp.float32)))
  p = 1 / (1 + np.exp(-logits))
  want = -(labels * np.log(p) + (1 - labels) * np.log(1 - p)).sum(-1)
  assert got.shape == (6,)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # Also agrees with sklearn's log_loss for one binary column (mean over rows).
  col = 3
  binary = np.stack([1 - p[:, col], p[:, col]], axis=-1)
  sk = log_loss(labels[:, col], binary, labels=[0, 1])
  mine = np.mean(np.asarray(sigmoid_xent(jnp.asarray(logits[:, col:col + 1], jnp.float32),
                                         jnp.asarray(labels[:, col:col + 1], jnp.float32))))
  assert mine == pytest.approx(sk, rel=1e-5)


def test_sigmoid_xent_is_finite_for_extreme_logits():
  logits = jnp.asarray([[80.0, -80.0]])
  labels = jnp.asarray([[0.0, 1.0]])
  got = float(sigmoid_xent(logits, labels)[0])
  assert got == pytest.approx(160.0, rel=1e-5)


def test_precision_at_1_multi_label_rows():
  logits = jnp.asarray([
      [0.1, 0.9, 0.0, 0.0],   # top = 1, in the label set {1, 3}
      [0.1, 0.0, 0.0, 0.9],   # top = 3, in the label set {1, 3}
      [0.9, 0.0, 0.0, 0.1],   # top = 0, not in {1, 3} even though 3 is ranked second
      [0.0, 0.0, 0.5, 0.1],   # top = 2, single label 2
      [0.0, 0.0, 0.5, 0.1],   # no labels at all: never correct
  ])
  labels = jnp.asarray([
      [0, 1, 0, 1],
      [0, 1, 0, 1],
      [0, 1, 0, 1],
      [0, 0, 1, 0],
      [0, 0, 0, 0],
  ], jnp.float32)
  got = np.asarray(precision_at_1(logits, labels))
  np.testing.assert_array_equal(got, [1.0, 1.0, 0.0, 1.0, 0.0])
  assert got.dtype == np.float32


def test_loss_registry_names():
  assert set(LOSSES) == {"softmax_xent", "sigmoid_xent"}
