"""Linear few-shot math: one-eigendecomposition ridge vs per-lambda lstsq, sampling, selection."""
from __future__ import annotations

import numpy as np
import pytest

from runner.evaluators import fewshot_math as fm


def _design(x, train_x, protocol):
  """The design matrix by hand: "reference" standardises with the training statistics (ddof 0,
  std + 1e-5) and appends 100, "plain" appends ones, None appends nothing."""
  x = np.asarray(x, np.float64)
  if protocol is None:
    return x
  bias = 1.0
  if protocol == "reference":
    train_x = np.asarray(train_x, np.float64)
    x = (x - train_x.mean(axis=0)) / (train_x.std(axis=0) + 1e-5)
    bias = 100.0
  return np.concatenate([x, np.full((len(x), 1), bias)], axis=1)


def _reference_weights(x, y, num_classes, l2_regs, protocol="plain"):
  """Each lambda solved on its own: lstsq of [X; sqrt(lambda) I] W = [Y; 0], X the design."""
  x = _design(x, x, protocol)
  targets = 2.0 * np.eye(num_classes)[y] - 1.0
  d1 = x.shape[1]
  return np.stack([
      np.linalg.lstsq(np.concatenate([x, np.sqrt(lam) * np.eye(d1)]),
                      np.concatenate([targets, np.zeros((d1, num_classes))]), rcond=None)[0]
      for lam in l2_regs])


def _reference_accuracies(x, y, test_x, test_y, num_classes, l2_regs, protocol="plain"):
  w = _reference_weights(x, y, num_classes, l2_regs, protocol)
  test_x = _design(test_x, x, protocol)
  return np.array([np.mean(np.argmax(test_x @ wl, axis=1) == test_y) for wl in w])


def _offset_data(n, d, num_classes, seed, offset=10.0):
  """Random features far from the origin, so a missing or unregularised bias changes the answer."""
  rng = np.random.default_rng(seed)
  return offset + rng.normal(size=(n, d)), rng.integers(num_classes, size=n)


@pytest.mark.parametrize("protocol", fm.PROTOCOLS)
@pytest.mark.parametrize("n,d", [(12, 20), (21, 20), (60, 5)],
                         ids=["dual", "dual-boundary", "primal"])
def test_ridge_weights_match_per_lambda_lstsq(n, d, protocol):
  x, y = _offset_data(n, d, num_classes=3, seed=n)
  p, s, q = fm.ridge_factors(x, y, 3, protocol)
  assert p.shape == (d + 1, min(n, d + 1)) and q.shape == (min(n, d + 1), 3)  # the regime taken
  w = np.einsum("ik,lk,kc->lic", p, 1.0 / (s[None, :] + fm.L2_REGS[:, None]), q)  # the weights
  ref = _reference_weights(x, y, 3, fm.L2_REGS, protocol)
  assert w.shape == (30, d + 1, 3) and w.dtype == np.float64
  scale = np.abs(ref).max(axis=(1, 2), keepdims=True)
  np.testing.assert_allclose(w / scale, ref / scale, rtol=0, atol=1e-8)


@pytest.mark.parametrize("protocol", fm.PROTOCOLS)
@pytest.mark.parametrize("n,d", [(15, 20), (80, 4)], ids=["dual", "primal"])
def test_ridge_accuracies_match_reference_predictions(n, d, protocol):
  x, y = _offset_data(n, d, num_classes=4, seed=1)
  tx, ty = _offset_data(101, d, num_classes=4, seed=2)
  acc = fm.ridge_accuracies(x.astype(np.float32), y, tx, ty, 4, chunk=7,  # chunks of test rows
                            protocol=protocol)
  ref = _reference_accuracies(x.astype(np.float32), y, tx, ty, 4, fm.L2_REGS, protocol)
  assert acc.shape == (30,)
  np.testing.assert_array_equal(acc, ref)
  assert len(np.unique(acc)) > 1  # the lambdas do not all predict alike


def test_bias_separates_data_offset_from_the_origin():
  """1-D classes at ~99.25 and ~100.75: separable by a threshold, not by a line through 0."""
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.uniform(99, 99.5, (10, 1)), rng.uniform(100.5, 101, (10, 1))])
  y = np.repeat([0, 1], 10)
  regs = fm.L2_REGS[:3]
  assert np.all(_reference_accuracies(x, y, x, y, 2, regs, protocol=None) == 0.5)
  for protocol in fm.PROTOCOLS:
    np.testing.assert_array_equal(
        fm.ridge_accuracies(x, y, x, y, 2, l2_regs=regs, protocol=protocol), 1.0)


def test_separable_blobs_perfect_at_small_lambda_chance_at_huge():
  rng = np.random.default_rng(0)
  num_classes, d = 4, 6
  means = 3 * rng.normal(size=(num_classes, d))

  def make(per_class):
    y = np.repeat(np.arange(num_classes), per_class)
    return 50 + means[y] + 0.1 * rng.normal(size=(len(y), d)), y

  (x, y), (tx, ty) = make(5), make(50)
  acc = fm.ridge_accuracies(x, y, tx, ty, num_classes, protocol="plain")
  assert acc[0] == 1.0
  # Shrunk to nothing, the scores follow the common offset: one class wins everywhere.
  assert acc[-1] <= 1 / num_classes + 0.05
  # The reference protocol centres the features and barely regularises its bias (feature 100):
  # the balanced classes share one bias, and the shrunk weights still point at the class means.
  acc = fm.ridge_accuracies(x, y, tx, ty, num_classes, protocol="reference")
  assert acc[0] == 1.0 and acc[-1] == 1.0


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


# --- the reference protocol (google-research/vmoe, vmoe/evaluate/fewshot.py) ------------------

def _vmoe_fewshot_accuracies(x, y, x_test, y_test, num_classes, l2_regs):
  """A NumPy transcription of vmoe's `_precompute_cache` and `_eig_fewshot_acc_fn` (float64)."""
  x, x_test = np.asarray(x, np.float64), np.asarray(x_test, np.float64)
  mean = np.mean(x, axis=0, keepdims=True)
  std = np.std(x, axis=0, keepdims=True) + 1e-5
  x = np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=100.0)
  y = 2.0 * np.eye(num_classes)[y] - 1.0
  num_points, dim = x.shape
  if num_points >= dim:
    eigs, q = np.linalg.eigh(x.T @ x)
    rhs, lhs = q.T @ (x.T @ y), q
  else:
    eigs, q = np.linalg.eigh(x @ x.T)
    rhs, lhs = q.T @ y, x.T @ q
  x_test = np.pad((x_test - mean) / std, ((0, 0), (0, 1)), constant_values=100.0)
  out = []
  for l2_reg in l2_regs:
    w = (lhs * (1.0 / (eigs + l2_reg)).reshape(1, -1)) @ rhs
    out.append(np.mean(np.argmax(x_test @ w, axis=1) == y_test))
  return np.array(out)


def _uneven_scales(seed, num_classes=5, d=12):
  """Informative features whose columns are scaled by 1e-3 ... 1e3 and offset from the origin."""
  rng = np.random.default_rng(seed)
  means = rng.normal(size=(num_classes, d))
  scales = 10.0 ** np.linspace(-3, 3, d)
  offsets = 10.0 * rng.normal(size=d) * scales

  def make(per_class):
    y = np.repeat(np.arange(num_classes), per_class)
    return ((means[y] + 1.5 * rng.normal(size=(len(y), d))) * scales + offsets), y
  return make


# Balanced shots decouple the bias from the centred features (its value cannot matter then);
# the unbalanced case is where the bias feature's 100 and its weak regularisation show.
@pytest.mark.parametrize("per_class", [1, 2, 10, [1, 2, 3, 4, 6]],
                         ids=["1shot-dual", "2shot-dual", "10shot-primal", "unbalanced"])
def test_reference_protocol_matches_vmoe_on_uneven_scales(per_class):
  make = _uneven_scales(len(str(per_class)))
  (x, y), (tx, ty) = make(per_class), make(60)
  ours = fm.ridge_accuracies(x, y, tx, ty, 5, protocol="reference")
  reference = _vmoe_fewshot_accuracies(x, y, tx, ty, 5, fm.L2_REGS)
  np.testing.assert_array_equal(ours, reference)  # the same predictions at every lambda
  np.testing.assert_array_equal(fm.ridge_accuracies(x, y, tx, ty, 5), reference)  # the default
  assert len(np.unique(reference)) > 1
  # The old solver (raw features, bias column 1) gives other answers on these features.
  assert not np.array_equal(fm.ridge_accuracies(x, y, tx, ty, 5, protocol="plain"), reference)


def test_reference_design_uses_the_training_statistics():
  rng = np.random.default_rng(0)
  train = rng.normal(size=(6, 3)) * [1e-3, 1.0, 1e3] + [5.0, -2.0, 7e3]
  test = rng.normal(size=(4, 3)) * 50.0  # other statistics: they must not be used
  design = fm.design_fn(train, "reference")
  want = (test - train.mean(axis=0)) / (train.std(axis=0) + 1e-5)
  np.testing.assert_allclose(design(test)[:, :3], want, rtol=1e-12)
  np.testing.assert_array_equal(design(test)[:, 3], 100.0)
  standardised = design(train)[:, :3]
  np.testing.assert_allclose(standardised.mean(axis=0), 0.0, atol=1e-9)
  np.testing.assert_allclose(standardised.std(axis=0),
                             train.std(axis=0) / (train.std(axis=0) + 1e-5))
  np.testing.assert_array_equal(fm.design_fn(train, "plain")(test), np.c_[test, np.ones(4)])
  with pytest.raises(ValueError, match="unknown few-shot protocol 'whiten'"):
    fm.design_fn(train, "whiten")


def test_fewshot_metrics_protocols():
  features = {"birds": _toy_dataset(0, 3), "pets": _toy_dataset(1, 5)}
  features = {k: (v[0] * np.geomspace(1e-3, 1e3, 8), v[1], v[2] * np.geomspace(1e-3, 1e3, 8),
                  *v[3:]) for k, v in features.items()}
  default = fm.fewshot_metrics(features, [2], [0, 1])
  assert default == fm.fewshot_metrics(features, [2], [0, 1], protocol="reference")
  plain = fm.fewshot_metrics(features, [2], [0, 1], protocol="plain")
  assert plain != default
  x, y, tx, ty, c = features["pets"]
  per_seed = [fm.ridge_accuracies(x[i], y[i], tx, ty, c, protocol="plain")
              for i in (fm.sample_shots(y, 2, seed, c) for seed in (0, 1))]
  assert plain["pets/2shot/accuracy"] in set(np.mean(per_seed, axis=0))
