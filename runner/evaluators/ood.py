"""Out-of-distribution detection: per-example scores and the metrics that compare them. In every
score, larger means more in-distribution, so one set of metrics serves all of them."""
from __future__ import annotations

import numpy as np

SCORES = ("msp", "max_logit", "entropy", "mahalanobis")


def logit_scores(logits: np.ndarray) -> dict[str, np.ndarray]:
  """Scores from (N, C) logits: max softmax probability, max logit, and negative softmax entropy.
  Computed in float64 through log-sum-exp, so large logits neither overflow nor give log(0)."""
  logits = np.asarray(logits, np.float64)
  max_logit = logits.max(axis=-1)
  shifted = logits - max_logit[:, None]
  log_normaliser = np.log(np.sum(np.exp(shifted), axis=-1))
  log_probs = shifted - log_normaliser[:, None]
  probs = np.exp(log_probs)
  # p log p -> 0 as p -> 0; the guard keeps a -inf logit from giving 0 * -inf = NaN.
  negative_entropy = np.sum(probs * np.where(probs > 0, log_probs, 0.0), axis=-1)
  return {"msp": np.exp(-log_normaliser), "max_logit": max_logit, "entropy": negative_entropy}


class MahalanobisFit:
  """Class means and one shared (tied) covariance of pre-logit features (Lee et al. 2018). Fitted on
  the in-distribution training split in a streaming way: per-class sums of x and a pooled sum of
  outer products, so memory does not grow with the split. The covariance is the pooled within-class
  one, normalised by the number of examples N (Lee et al.'s estimator)."""

  def __init__(self, num_classes: int, dim: int):
    self.num_classes, self.dim = num_classes, dim
    self.class_counts = np.zeros(num_classes, np.int64)
    self.class_sums = np.zeros((num_classes, dim), np.float64)
    self.outer_sum = np.zeros((dim, dim), np.float64)
    # Sums are of x - shift, with shift the mean of the first batch: the covariance is then a
    # difference of numbers of the size of the spread, not of the squared mean (no cancellation).
    self.shift: np.ndarray | None = None
    self.means: np.ndarray | None = None  # (C, D); NaN rows for classes never seen
    self.precision: np.ndarray | None = None  # (D, D)

  def update(self, features: np.ndarray, labels: np.ndarray, mask: np.ndarray | None = None) -> None:
    """features (N, D); labels (N, C) one-hot (argmax is the class) or (N,) ints; mask (N,) bool."""
    features, labels = np.asarray(features, np.float64), np.asarray(labels)
    classes = labels.argmax(axis=-1) if labels.ndim == 2 else labels.astype(np.int64)
    if mask is not None:
      mask = np.asarray(mask, bool)
      features, classes = features[mask], classes[mask]
    if not len(features):
      return
    if self.shift is None:
      self.shift = features.mean(axis=0)
    centred = features - self.shift
    self.class_counts += np.bincount(classes, minlength=self.num_classes)
    np.add.at(self.class_sums, classes, centred)
    self.outer_sum += centred.T @ centred
    self.means = self.precision = None  # stale until the next finalize()

  def finalize(self) -> None:
    """Computes the class means and the precision: the pseudo-inverse of the pooled covariance."""
    num_examples = self.class_counts.sum()
    if not num_examples:
      raise ValueError("MahalanobisFit.finalize() before any example was seen")
    seen = self.class_counts > 0
    centred_means = self.class_sums[seen] / self.class_counts[seen, None]
    # Within-class scatter: sum_i x_i x_i^T - sum_c n_c mu_c mu_c^T (all relative to the shift).
    scatter = self.outer_sum - (centred_means * self.class_counts[seen, None]).T @ centred_means
    covariance = scatter / num_examples
    self.precision = np.linalg.pinv((covariance + covariance.T) / 2)
    self.means = np.full((self.num_classes, self.dim), np.nan)
    self.means[seen] = centred_means + self.shift

  def unreliable(self) -> str | None:
    """Why the fitted covariance cannot be trusted, or None: the pooled within-class covariance
    of N examples of C classes has rank at most N - C, so with N - C below the feature width it
    is singular, and its pseudo-inverse measures distance only along the few directions the
    training features span."""
    seen = int((self.class_counts > 0).sum())
    examples = int(self.class_counts.sum())
    if examples - seen >= self.dim:
      return None
    return (f"the Mahalanobis score's covariance of {self.dim}-dimensional pre-logits was "
            f"fitted on {examples} training images of {seen} classes: it is singular (rank at "
            f"most {examples - seen} < {self.dim}), so that score cannot be trusted; fit it on "
            f"more than {self.dim + seen} training images (many times more for a stable one)")

  def score(self, features: np.ndarray) -> np.ndarray:
    """-min_c (x - mu_c)^T Sigma^-1 (x - mu_c) over the classes seen in training; (N,)."""
    if self.precision is None:
      raise ValueError("MahalanobisFit.score() before finalize()")
    # Expanded as x'Px - 2 x'P mu + mu'P mu, so no (N, C, D) array is ever formed.
    centred = np.asarray(features, np.float64) - self.shift
    centred_means = self.means[self.class_counts > 0] - self.shift
    projected = centred @ self.precision
    distances = (np.sum(projected * centred, axis=-1)[:, None] - 2 * projected @ centred_means.T
                 + np.sum((centred_means @ self.precision) * centred_means, axis=-1)[None, :])
    return -distances.min(axis=-1)


def _accepted_counts(in_scores: np.ndarray, out_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(in-distribution, OOD) counts with score >= t, for each distinct score t from high to low. Tied
  scores form one threshold, so no ordering among ties is ever assumed."""
  scores = np.concatenate([in_scores, out_scores]).astype(np.float64)
  is_in = np.concatenate([np.ones(len(in_scores)), np.zeros(len(out_scores))])
  order = np.argsort(scores, kind="stable")[::-1]
  scores, is_in = scores[order], is_in[order]
  last_of_each_threshold = np.append(np.flatnonzero(np.diff(scores)), len(scores) - 1)
  accepted_in = np.cumsum(is_in)[last_of_each_threshold]
  accepted_out = last_of_each_threshold + 1 - accepted_in
  return accepted_in, accepted_out


def _average_precision(positive_scores: np.ndarray, negative_scores: np.ndarray) -> float:
  """sum_n (R_n - R_{n-1}) P_n over distinct thresholds from high to low, as scikit-learn defines it."""
  true_positives, false_positives = _accepted_counts(positive_scores, negative_scores)
  precision = true_positives / (true_positives + false_positives)
  recall = true_positives / len(positive_scores)
  return float(np.sum(np.diff(recall, prepend=0.0) * precision))


def _fpr_at_95_tpr(positive_scores: np.ndarray, negative_scores: np.ndarray) -> float:
  """The fraction of negatives scored >= the highest threshold that catches >= 95% of positives. The
  first point of the ROC curve (distinct thresholds descending, no intermediate point dropped) whose
  TPR >= 0.95: the smallest FPR that reaches it; no interpolation."""
  true_positives, false_positives = _accepted_counts(positive_scores, negative_scores)
  first = np.argmax(true_positives / len(positive_scores) >= 0.95)  # the last threshold: TPR 1
  return float(false_positives[first] / len(negative_scores))


def detection_metrics(in_scores: np.ndarray, out_scores: np.ndarray) -> dict[str, float]:
  """AUROC, AUPRC-in/out and FPR at 95% TPR in both conventions of the literature. An example is
  accepted as in-distribution when its score is >= the threshold; thresholds are the distinct
  observed scores. auroc is the Mann-Whitney U / (n_in n_out) with ties counted 1/2 (the trapezoid
  under the tie-grouped ROC curve), the same whichever class is positive. auprc_in: average
  precision, in-dist positive; auprc_out: OOD positive with negated scores.

  FPR@95 is reported twice, as docs/evaluation.md states, because papers use both and they differ:
  fpr95_in_positive (Hendrycks & Gimpel 2017) and fpr95_ood_positive (uncertainty-baselines'
  `compute_ood_metrics`, used by the E³ paper: `fpr[argmax(tpr >= 0.95)]` of
  `sklearn.metrics.roc_curve(is_ood, -score)`, here with no point dropped, which matters only when
  tied scores make a straight run of the curve end past 95%). Both take the first point of the ROC
  curve whose TPR >= 0.95, with no interpolation."""
  in_scores = np.asarray(in_scores, np.float64).ravel()
  out_scores = np.asarray(out_scores, np.float64).ravel()
  if not len(in_scores) or not len(out_scores):
    raise ValueError("detection_metrics needs at least one in-distribution and one OOD score")
  accepted_in, accepted_out = _accepted_counts(in_scores, out_scores)
  # Each new threshold adds a trapezoid: width = newly accepted OOD, mean height = accepted in-dist
  # before and after; pairs tied across the two sets thus count 1/2.
  previous_in = np.concatenate([[0.0], accepted_in[:-1]])
  u_statistic = np.sum(np.diff(accepted_out, prepend=0) * (previous_in + accepted_in) / 2)
  return {
      "auroc": float(u_statistic / (len(in_scores) * len(out_scores))),
      "auprc_in": _average_precision(in_scores, out_scores),
      "auprc_out": _average_precision(-out_scores, -in_scores),
      "fpr95_in_positive": _fpr_at_95_tpr(in_scores, out_scores),
      "fpr95_ood_positive": _fpr_at_95_tpr(-out_scores, -in_scores),
  }
