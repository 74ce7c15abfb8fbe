"""Linear few-shot math: one-eigendecomposition ridge vs per-lambda lstsq, sampling, selection."""
from __future__ import annotations

import numpy as np
import pytest

from runner.evaluators import fewshot_math as fm


def _reference_weights(x, y, num_classes, l2_regs, bias=True):
  """Each lambda solved on its own: lstsq of [X; sqrt(lambda) I] W = [Y; 0], X with ones column."""
  x = np.asarray(x, np.float64)
  if bias:
    x = np.concatenate([x, np.ones((len(x), 1))], axis=1)
  targets = 2.0 * np.eye(num_classes)[y] - 1.0
  d1 = x.shape[1]
  return np.stack([
      np.linalg.lstsq(np.concatenate([x, np.sqrt(lam) * np.eye(d1)]),
                      np.concatenate([targets, np.zeros((d1, num_classes))]), rcond=None)[0]
      for lam in l2_regs])


def _reference_accuracies(x, y, test_x, test_y, num_classes, l2_regs, bias=True):
  w = _reference_weights(x, y, num_classes, l2_regs, bias)
  test_x = np.asarray(test_x, np.float64)
  if bias:
    test_x = np.concatenate([test_x, np.ones((len(test_x), 1))], axis=1)
  return np.array([np.mean(np.argmax(test_x @ wl, axis=1) == test_y) for wl in w])


def _offset_data(n, d, num_classes, seed, offset=10.0):
  """Random features far from the origin, so a missing or unregularised bias changes the answer."""
  rng = np.random.default_rng(seed)
  return offset + rng.normal(size=(n, d)), rng.integers(num_classes, size=n)


@pytest.mark.parametrize("n,d", [(12, 20), (21, 20), (60, 5)],
                         ids=["dual", "dual-boundary", "primal"])
def test_ridge_weights_match_per_lambda_lstsq(n, d):
  x, y = _offset_data(n, d, num_classes=3, seed=n)
  p, s, q = fm.ridge_factors(x, y, 3)
  assert p.shape == (d + 1, min(n, d + 1)) and q.shape == (min(n, d + 1), 3)  # the regime taken
  w = fm.ridge_weights(x, y, 3)
  ref = _reference_weights(x, y, 3, fm.L2_REGS)
  assert w.shape == (30, d + 1, 3) and w.dtype == np.float64
  scale = np.abs(ref).max(axis=(1, 2), keepdims=True)
  np.testing.assert_allclose(w / scale, ref / scale, rtol=0, atol=1e-8)


@pytest.mark.parametrize("n,d", [(15, 20), (80, 4)], ids=["dual", "primal"])
def test_ridge_accuracies_match_reference_predictions(n, d):
  x, y = _offset_data(n, d, num_classes=4, seed=1)
  tx, ty = _offset_data(101, d, num_classes=4, seed=2)
  acc = fm.ridge_accuracies(x.astype(np.float32), y, tx, ty, 4, chunk=7)  # chunks of test rows
  ref = _reference_accuracies(x.astype(np.float32), y, tx, ty, 4, fm.L2_REGS)
  assert acc.shape == (30,)
  np.testing.assert_array_equal(acc, ref)
  assert len(np.unique(acc)) > 1  # the lambdas do not all predict alike


def test_bias_separates_data_offset_from_the_origin():
  """1-D classes at ~99.25 and ~100.75: separable by a threshold, not by a line through 0."""
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.uniform(99, 99.5, (10, 1)), rng.uniform(100.5, 101, (10, 1))])
  y = np.repeat([0, 1], 10)
  regs = fm.L2_REGS[:3]
  assert np.all(_reference_accuracies(x, y, x, y, 2, regs, bias=False) == 0.5)
  np.testing.assert_array_equal(fm.ridge_accuracies(x, y, x, y, 2, l2_regs=regs), 1.0)


def test_separable_blobs_perfect_at_small_lambda_chance_at_huge():
  rng = np.random.default_rng(0)
  num_classes, d = 4, 6
  means = 3 * rng.normal(size=(num_classes, d))

  def make(per_class):
    y = np.repeat(np.arange(num_classes), per_class)
    return 50 + means[y] + 0.1 * rng.normal(size=(len(y), d)), y

  (x, y), (tx, ty) = make(5), make(50)
  acc = fm.ridge_accuracies(x, y, tx, ty, num_classes)
  assert acc[0] == 1.0
  # Shrunk to nothing, the scores follow the common offset: one class wins everywhere.
  assert acc[-1] <= 1 / num_classes + 0.05


def test_sample_shots_balanced_without_replacement_and_seeded():
  rng = np.random.default_rng(0)
  labels = rng.permutation(np.repeat(np.arange(5), [7, 9, 3, 12, 5]))
  idx = fm.sample_shots(labels, 3, seed=0, num_classes=5)
  assert len(idx) == 15 and len(np.unique(idx)) == 15
  np.testing.assert_array_equal(np.bincount(labels[idx], minlength=5), 3)
  np.testing.assert_array_equal(fm.sample_shots(labels, 3, seed=0, num_classes=5), idx)
  assert not np.array_equal(fm.sample_shots(labels, 3, seed=1, num_classes=5), idx)
  # A class with exactly `shots` examples gives all of them.
  assert set(np.flatnonzero(labels == 2)) <= set(idx)
  # For one seed, fewer shots take a subset of the larger sample.
  assert set(fm.sample_shots(labels, 2, seed=0, num_classes=5)) <= set(idx)


def test_sample_shots_raises_when_a_class_is_too_small():
  labels = np.repeat(np.arange(3), [5, 2, 5])
  with pytest.raises(fm.FewShotError, match=r"class 1 has 2 .*5 shots") as err:
    fm.sample_shots(labels, 5, seed=0, num_classes=3)
  assert isinstance(err.value, ValueError)
  with pytest.raises(fm.FewShotError, match="class 3 has 0"):  # a class with no examples at all
    fm.sample_shots(labels, 2, seed=0, num_classes=4)


def test_mean_ranks_average_ties():
  ranks = fm.mean_ranks({"a": np.array([0.5, 0.9, 0.9, 0.1]), "b": np.array([0.4, 0.3, 0.2, 0.1])})
  np.testing.assert_allclose(ranks, [(2 + 0) / 2, (0.5 + 1) / 2, (0.5 + 2) / 2, (3 + 3) / 2])


def test_select_by_mean_rank_hand_made_tables():
  assert fm.select_by_mean_rank({"a": np.array([0.1, 0.7, 0.3])}) == 1
  # Tied mean rank between lambdas 1 and 2 goes to the smaller one, in either dataset order.
  a, b = np.array([0.1, 0.8, 0.9]), np.array([0.1, 0.9, 0.8])
  assert fm.select_by_mean_rank({"a": a, "b": b}) == 1
  assert fm.select_by_mean_rank({"b": b, "a": a}) == 1
  # A three-way tie in "a" shares rank 1, so "b" decides.
  assert fm.select_by_mean_rank({"a": np.array([0.9, 0.9, 0.9, 0.1]),
                                 "b": np.array([0.1, 0.2, 0.3, 0.99])}) == 2
  # The mean accuracy prefers lambda 1 (0.63 vs 0.45); two datasets out of three prefer lambda 0.
  table = {"a": np.array([0.30, 0.90]), "b": np.array([0.52, 0.50]), "c": np.array([0.52, 0.50])}
  assert np.argmax(np.mean(list(table.values()), axis=0)) == 1
  assert fm.select_by_mean_rank(table) == 0


def _toy_dataset(seed, num_classes, d=8, per_class=6):
  rng = np.random.default_rng(seed)
  means = rng.normal(size=(num_classes, d))

  def make(k):
    y = np.repeat(np.arange(num_classes), k)
    return (means[y] + rng.normal(size=(len(y), d))).astype(np.float32), y

  return (*make(per_class), *make(20), num_classes)


def test_fewshot_metrics_keys_and_mean():
  features = {"birds": _toy_dataset(0, 3), "pets": _toy_dataset(1, 5)}
  shots, seeds = [1, 2], [0, 1, 2]
  metrics = fm.fewshot_metrics(features, shots, seeds)
  assert set(metrics) == {f"{name}/{s}shot/accuracy" for name in ["birds", "pets", "mean"]
                          for s in shots} | {f"mean/{s}shot/l2_reg" for s in shots}
  assert all(type(v) is float for v in metrics.values())
  for s in shots:
    assert metrics[f"mean/{s}shot/accuracy"] == pytest.approx(
        (metrics[f"birds/{s}shot/accuracy"] + metrics[f"pets/{s}shot/accuracy"]) / 2)
    # Recomputed by hand: seed-mean accuracies, then the lambda of the best mean rank.
    per = {}
    for name, (x, y, tx, ty, c) in features.items():
      per[name] = np.mean([fm.ridge_accuracies(x[i], y[i], tx, ty, c) for i in
                           (fm.sample_shots(y, s, seed, c) for seed in seeds)], axis=0)
    best = fm.select_by_mean_rank(per)
    assert metrics[f"mean/{s}shot/l2_reg"] == fm.L2_REGS[best]
    for name in features:
      assert metrics[f"{name}/{s}shot/accuracy"] == per[name][best]


def test_fewshot_metrics_names_the_dataset_that_is_too_small():
  with pytest.raises(fm.FewShotError, match=r"'pets', 7 shots: class 0 has 6"):
    fm.fewshot_metrics({"pets": _toy_dataset(1, 5)}, [7], [0])
  with pytest.raises(ValueError, match="ascending"):
    fm.fewshot_metrics({"pets": _toy_dataset(1, 5)}, [1], [0], l2_regs=[1.0, 0.5])
