"""OOD scores and detection metrics against scikit-learn, SciPy and a direct NumPy Mahalanobis fit."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.special
import scipy.stats
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from runner.evaluators.ood import SCORES, MahalanobisFit, detection_metrics, logit_scores


def sklearn_metrics(in_scores: np.ndarray, out_scores: np.ndarray) -> dict[str, float]:
  is_in = np.r_[np.ones(len(in_scores)), np.zeros(len(out_scores))]
  scores = np.r_[in_scores, out_scores]
  # Every threshold kept: dropping collinear ROC points can skip the first one with TPR >= 0.95.
  fpr, tpr, _ = roc_curve(is_in, scores, drop_intermediate=False)
  # uncertainty-baselines (baselines/jft/ood_utils.py): OOD labelled 1, scored by the uncertainty.
  fpr_ood, tpr_ood, _ = roc_curve(1 - is_in, -scores, drop_intermediate=False)
  return {"auroc": roc_auc_score(is_in, scores),
          "auprc_in": average_precision_score(is_in, scores),
          "auprc_out": average_precision_score(1 - is_in, -scores),
          "fpr95_in_positive": fpr[np.argmax(tpr >= 0.95)],
          "fpr95_ood_positive": fpr_ood[np.argmax(tpr_ood >= 0.95)]}


def numpy_fpr95(in_scores, out_scores):
  """Both conventions by brute force over every candidate threshold, ties included.

  in-positive: accept as in-dist when score >= t; the largest t accepting >= 95% of in-dist
  gives the fraction of OOD accepted. ood-positive: flag as OOD when score <= t; the smallest t
  flagging >= 95% of OOD gives the fraction of in-dist flagged.
  """
  thresholds = np.unique(np.r_[in_scores, out_scores])
  in_t = max(t for t in thresholds if np.mean(in_scores >= t) >= 0.95)
  ood_t = min(t for t in thresholds if np.mean(out_scores <= t) >= 0.95)
  return {"fpr95_in_positive": np.mean(out_scores >= in_t),
          "fpr95_ood_positive": np.mean(in_scores <= ood_t)}


@pytest.mark.parametrize("seed, num_in, num_out, decimals", [
    (0, 200, 300, None),  # continuous scores, no ties
    (1, 150, 120, 1),  # heavy ties, some across the two sets
    (2, 40, 500, 0),  # very heavy ties
    (3, 20, 7, 2),  # TPR lands exactly on 0.95 (19 / 20)
    (4, 1000, 50, 1),
])
def test_detection_metrics_match_sklearn(seed, num_in, num_out, decimals):
  rng = np.random.default_rng(seed)
  in_scores = rng.normal(1.0, 1.0, size=num_in)
  out_scores = rng.normal(0.0, 1.5, size=num_out)
  if decimals is not None:
    in_scores, out_scores = np.round(in_scores, decimals), np.round(out_scores, decimals)
  got = detection_metrics(in_scores, out_scores)
  want = sklearn_metrics(in_scores, out_scores)
  assert set(got) == set(want)
  for key in want:
    assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-14), key
  # AUROC is the Mann-Whitney U statistic with ties counted 1/2.
  u_statistic = scipy.stats.mannwhitneyu(in_scores, out_scores).statistic
  assert got["auroc"] == pytest.approx(u_statistic / (num_in * num_out), rel=1e-12)
  brute = numpy_fpr95(in_scores, out_scores)
  for key in brute:
    assert got[key] == pytest.approx(brute[key], rel=1e-12, abs=1e-14), key
  if decimals is None:  # no ties: uncertainty-baselines' call (drop_intermediate=True) agrees
    is_ood = np.r_[np.zeros(num_in), np.ones(num_out)]
    fpr, tpr, _ = roc_curve(is_ood, -np.r_[in_scores, out_scores])
    assert got["fpr95_ood_positive"] == fpr[np.argmax(tpr >= 0.95)]


def test_fpr95_conventions_differ():
  in_scores = np.arange(1.0, 101.0)  # in-dist: 1 ... 100
  # OOD: 95 below every in-dist example, 5 above all of them.
  out_scores = np.r_[np.full(95, 0.5), np.full(5, 200.0)]
  got = detection_metrics(in_scores, out_scores)
  # Accepting 95% of in-dist (score >= 6) accepts the 5 OOD at 200.
  assert got["fpr95_in_positive"] == pytest.approx(0.05)
  # Flagging 95% of OOD (score <= 0.5) flags no in-dist example.
  assert got["fpr95_ood_positive"] == 0.0
  for key, value in numpy_fpr95(in_scores, out_scores).items():
    assert got[key] == pytest.approx(value), key
  # Mirrored (in-dist and OOD swapped, scores negated), the two conventions swap.
  mirrored = detection_metrics(-out_scores, -in_scores)
  assert mirrored["fpr95_in_positive"] == got["fpr95_ood_positive"]
  assert mirrored["fpr95_ood_positive"] == got["fpr95_in_positive"]


def test_fpr95_threshold_is_inclusive():
  # 20 in-dist: 19 at 1.0 and 1 at -5; threshold 1.0 accepts exactly 95% of them. OOD: one at 1.0
  # (tied, accepted), one at 0.5 (rejected), two far below.
  in_scores = np.r_[np.ones(19), -5.0]
  out_scores = np.array([1.0, 0.5, -10.0, -10.0])
  assert detection_metrics(in_scores, out_scores)["fpr95_in_positive"] == pytest.approx(0.25)
  # OOD positive: flagging (score <= t) 95% of the 4 OOD needs all of them, t = 1.0, which also
  # flags every in-dist example.
  assert detection_metrics(in_scores, out_scores)["fpr95_ood_positive"] == 1.0
  # ...and its threshold is inclusive too: 19 of 20 OOD at -1 flag exactly 95% at t = -1.
  out_scores = np.r_[np.full(19, -1.0), 3.0]
  in_scores = np.array([-1.0, 0.0, 2.0, 2.0])  # one in-dist tied at -1: flagged with them
  assert detection_metrics(in_scores, out_scores)["fpr95_ood_positive"] == pytest.approx(0.25)


def test_separated_and_reversed_scores():
  in_scores, out_scores = np.linspace(1, 2, 50), np.linspace(-2, 0, 30)
  separated = detection_metrics(in_scores, out_scores)
  assert separated == pytest.approx({"auroc": 1.0, "auprc_in": 1.0, "auprc_out": 1.0,
                                     "fpr95_in_positive": 0.0, "fpr95_ood_positive": 0.0},
                                    abs=1e-15)
  reversed_ = detection_metrics(out_scores, in_scores)
  assert reversed_["auroc"] == 0.0
  assert reversed_["fpr95_in_positive"] == reversed_["fpr95_ood_positive"] == 1.0
  # All tied: no information, AUROC 1/2 and precision = the base rate.
  tied = detection_metrics(np.zeros(10), np.zeros(30))
  assert tied == {"auroc": 0.5, "auprc_in": 0.25, "auprc_out": 0.75, "fpr95_in_positive": 1.0,
                  "fpr95_ood_positive": 1.0}


def test_logit_scores_match_scipy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(64, 10)) * 5
  got = logit_scores(logits)
  assert set(got) == set(SCORES) - {"mahalanobis"}
  probs = scipy.special.softmax(logits, axis=-1)
  np.testing.assert_allclose(got["msp"], probs.max(-1), rtol=1e-12)
  np.testing.assert_array_equal(got["max_logit"], logits.max(-1))
  np.testing.assert_allclose(got["entropy"], -scipy.stats.entropy(probs, axis=-1), rtol=1e-10, atol=1e-14)
  assert all(v.shape == (64,) for v in got.values())
  # Larger = more in-distribution: a confident row beats a flat one on every score.
  scores = logit_scores(np.array([[10.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
  assert all(scores[name][0] > scores[name][1] for name in scores)


def test_logit_scores_are_stable_for_extreme_logits():
  logits = np.array([[1000.0, 0.0, -1000.0], [-1000.0, -1000.0, -1000.0], [5.0, -np.inf, 0.0]],
                    np.float32)
  got = logit_scores(logits)
  assert all(np.isfinite(v).all() for v in got.values())
  assert got["msp"][0] == pytest.approx(1.0) and got["entropy"][0] == pytest.approx(0.0, abs=1e-12)
  assert got["msp"][1] == pytest.approx(1 / 3) and got["entropy"][1] == pytest.approx(-np.log(3))
  np.testing.assert_allclose(got["entropy"][2], -scipy.stats.entropy(scipy.special.softmax([5.0, 0.0])))


def direct_mahalanobis(features: np.ndarray, classes: np.ndarray, num_classes: int):
  """Means, np.cov of the within-class residuals (normalised by N), and np.linalg.pinv, all at once."""
  means = np.stack([features[classes == c].mean(0) for c in range(num_classes)])
  residuals = features - means[classes]
  precision = np.linalg.pinv(np.cov(residuals, rowvar=False, bias=True))
  return means, precision


def direct_scores(features: np.ndarray, means: np.ndarray, precision: np.ndarray) -> np.ndarray:
  distances = [[(x - mu) @ precision @ (x - mu) for mu in means] for x in features]
  return -np.min(distances, axis=1)


def gaussian_features(rng, num_examples: int, num_classes: int, dim: int, offset: float = 3.0):
  classes = rng.integers(0, num_classes, size=num_examples)
  centres = rng.normal(size=(num_classes, dim)) * 2 + offset  # a large common mean, as pre-logits have
  mixing = rng.normal(size=(dim, dim)) / np.sqrt(dim)
  return centres[classes] + rng.normal(size=(num_examples, dim)) @ mixing, classes


def test_mahalanobis_fit_matches_direct_fit_one_hot_labels():
  rng = np.random.default_rng(0)
  features, classes = gaussian_features(rng, 400, 4, 6)
  fit = MahalanobisFit(num_classes=4, dim=6)
  fit.update(features.astype(np.float32), np.eye(4)[classes])
  fit.finalize()
  means, precision = direct_mahalanobis(features.astype(np.float32).astype(np.float64), classes, 4)
  np.testing.assert_allclose(fit.means, means, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(fit.precision, precision, rtol=1e-8, atol=1e-10)
  queries = rng.normal(size=(25, 6)) * 3
  np.testing.assert_allclose(fit.score(queries), direct_scores(queries, means, precision), rtol=1e-8)


def test_mahalanobis_streaming_with_masks_equals_one_shot():
  rng = np.random.default_rng(1)
  features, classes = gaussian_features(rng, 250, 3, 5, offset=100.0)
  one_shot = MahalanobisFit(3, 5)
  one_shot.update(features, classes)
  one_shot.finalize()

  streamed = MahalanobisFit(3, 5)
  streamed.update(np.zeros((4, 5)), np.zeros(4, np.int64), mask=np.zeros(4, bool))  # all padding
  bounds = [0, 3, 100, 101, 250]
  for start, stop in zip(bounds[:-1], bounds[1:]):
    padding = 5
    chunk = np.concatenate([features[start:stop], rng.normal(size=(padding, 5)) * 1e3])
    chunk_labels = np.eye(3)[np.r_[classes[start:stop], np.zeros(padding, np.int64)]]
    streamed.update(chunk, chunk_labels, mask=np.arange(len(chunk)) < stop - start)
  streamed.finalize()
  np.testing.assert_allclose(streamed.means, one_shot.means, rtol=1e-12)
  np.testing.assert_allclose(streamed.precision, one_shot.precision, rtol=1e-8)
  means, precision = direct_mahalanobis(features, classes, 3)
  np.testing.assert_allclose(streamed.precision, precision, rtol=1e-8)
  queries = features[:20] + rng.normal(size=(20, 5))
  np.testing.assert_allclose(streamed.score(queries), direct_scores(queries, means, precision),
                             rtol=1e-7)


def test_mahalanobis_rank_deficient_covariance_uses_pseudo_inverse():
  rng = np.random.default_rng(2)
  features, classes = gaussian_features(rng, 100, 2, 3)
  features = np.concatenate([features, features[:, :1] * 2 - features[:, 1:2]], axis=1)  # rank 3 of 4
  fit = MahalanobisFit(2, 4)
  fit.update(features, classes)
  fit.finalize()
  means, precision = direct_mahalanobis(features, classes, 2)
  np.testing.assert_allclose(fit.precision, precision, rtol=1e-6, atol=1e-8)
  assert np.isfinite(fit.score(features)).all()


def test_mahalanobis_points_far_from_both_clusters_score_lower():
  rng = np.random.default_rng(3)
  dim = 8
  centres = np.stack([np.full(dim, -5.0), np.full(dim, 5.0)])
  classes = rng.integers(0, 2, size=300)
  features = centres[classes] + rng.normal(size=(300, dim))
  fit = MahalanobisFit(2, dim)
  fit.update(features, classes)
  fit.finalize()
  train_scores = fit.score(features)
  far = np.concatenate([np.zeros((20, dim)),  # between the clusters
                        rng.normal(size=(20, dim)) + 20.0,
                        np.tile(np.r_[5.0, -5.0], dim // 2)[None] + rng.normal(size=(20, dim))])
  far_scores = fit.score(far)
  assert far_scores.max() < train_scores.min()
  assert detection_metrics(train_scores, far_scores)["auroc"] == 1.0


def test_a_covariance_from_fewer_examples_than_dimensions_is_said_to_be_untrustworthy():
  rng = np.random.default_rng(0)
  dim, classes = 16, 3
  few = MahalanobisFit(classes, dim)
  few.update(rng.normal(size=(12, dim)), np.arange(12) % classes)
  few.finalize()
  # The pooled within-class scatter of 12 examples of 3 classes has rank 9 < 16: singular.
  assert np.linalg.matrix_rank(np.linalg.pinv(few.precision)) == 12 - classes
  assert "singular (rank at most 9 < 16)" in few.unreliable()
  assert "more than 19 training images" in few.unreliable()
  enough = MahalanobisFit(classes, dim)
  enough.update(rng.normal(size=(19, dim)), np.arange(19) % classes)
  enough.finalize()
  assert np.linalg.matrix_rank(np.linalg.pinv(enough.precision)) == dim
  assert enough.unreliable() is None
