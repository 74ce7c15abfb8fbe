"""Ensemble metrics from member predictions, accumulated batch by batch.

Every kind of ensemble ends as member logits (B, M, C) per batch, which
`runner.models.ensemble.combine_logits` turns into "logits" of the mean probability, so the
single-model code works on the ensemble unchanged. `EnsembleStats` adds what only an ensemble has:
per-member metrics and pairwise diversity (Allingham et al. 2022's KL, and disagreement). Only
running sums are kept, so memory stays flat in the split size."""
from __future__ import annotations

import numpy as np

from runner.evaluators.calibration import CalibrationAccumulator

# Floor for probabilities under a log (as predictions.py): a member that puts exactly 0 on a class
# then costs -log(1e-12) ~ 27.6 nats instead of inf.
_EPS = 1e-12
# Added to the ensemble error before dividing by it (the normalised disagreement).
_DISAGREEMENT_EPS = 1e-7


class EnsembleStats:
  """Running per-member and diversity statistics of an ensemble over one split. Per member: prec@1,
  NLL and ECE as `PredictionStats` defines them for a single model. Diversity (docs/ensembles.md),
  averaged over unordered pairs i < j and over test points; for sigmoid models the KL sums the
  classes' Bernoulli KLs. A zero p_i term adds 0 to the KL; a zero p_j under a positive p_i is
  floored at 1e-12 (a large finite KL rather than inf)."""

  def __init__(self, *, num_bins: int = 15, output: str = "softmax", keep: bool = False):
    if output not in ("softmax", "sigmoid"):
      raise ValueError(f"output must be 'softmax' or 'sigmoid', got {output!r}")
    self.num_bins, self.output, self.keep = num_bins, output, keep
    self.shape: tuple[int, int] | None = None  # (M, C), fixed by the first batch
    self.count = 0
    self.ensemble_correct = 0.0
    self.member_sums: dict[str, np.ndarray] = {}
    self.diversity_sums = {"kl": 0.0, "cosine_similarity": 0.0, "disagreement": 0.0}
    self.calibration: list[CalibrationAccumulator] = []
    self._kept: list[np.ndarray] = []

  def update(self, member_probs, labels, mask) -> None:
    """member_probs (B, M, C); labels (B, C) one-hot or multi-hot; mask (B,) bool of real rows."""
    probs = np.asarray(member_probs, np.float64)
    if probs.ndim != 3:
      raise ValueError(f"member_probs must be (B, M, C), got shape {probs.shape}")
    if self.shape is None:
      self.shape = probs.shape[1:]
      self.member_sums = {"prec@1": np.zeros(self.shape[0]), "nll": np.zeros(self.shape[0])}
      self.calibration = [CalibrationAccumulator(self.num_bins) for _ in range(self.shape[0])]
    elif probs.shape[1:] != self.shape:
      raise ValueError(f"member_probs (B, M, C) changed from (·, {self.shape[0]}, {self.shape[1]}) "
                       f"to {probs.shape}")
    mask = np.asarray(mask, bool)
    probs, labels = probs[mask], np.asarray(labels, np.float64)[mask]
    num_rows, num_members, _ = probs.shape
    if num_rows == 0:
      return
    self.count += num_rows
    if self.keep:
      self._kept.append(probs.astype(np.float32))
    rows = np.arange(num_rows)

    # Per member: (B, M) correctness and NLL.
    top = probs.argmax(-1)
    self.member_sums["prec@1"] += (labels[rows[:, None], top] > 0).sum(0)
    log_p, log_not_p = np.log(np.maximum(probs, _EPS)), np.log(np.maximum(1 - probs, _EPS))
    if self.output == "sigmoid":
      nll = -(labels[:, None] * log_p + (1 - labels[:, None]) * log_not_p).sum(-1)
    else:
      target = labels / np.maximum(labels.sum(-1, keepdims=True), _EPS)
      nll = -(target[:, None] * log_p).sum(-1)
    self.member_sums["nll"] += nll.sum(0)
    for m, accumulator in enumerate(self.calibration):
      accumulator.update(probs[:, m], labels)

    mean_top = probs.mean(1).argmax(-1)
    self.ensemble_correct += float((labels[rows, mean_top] > 0).sum())

    # Diversity over unordered pairs i < j: (B, P) per point and pair, averaged over pairs.
    first, second = np.triu_indices(num_members, k=1)
    if len(first) == 0:
      return
    p_i, p_j = probs[:, first], probs[:, second]
    kl = _kl_terms(p_i, p_j)
    if self.output == "sigmoid":
      kl += _kl_terms(1 - p_i, 1 - p_j)
    norms = np.linalg.norm(probs, axis=-1)
    cosine = (p_i * p_j).sum(-1) / np.maximum(norms[:, first] * norms[:, second], _EPS)
    disagree = top[:, first] != top[:, second]
    self.diversity_sums["kl"] += float(kl.mean(-1).sum())
    self.diversity_sums["cosine_similarity"] += float(cosine.mean(-1).sum())
    self.diversity_sums["disagreement"] += float(disagree.mean(-1).sum())

  def metrics(self, prefix: str) -> dict[str, float]:
    """Per-member, member-mean and (for M ≥ 2) diversity metrics; NaN before any real row."""
    if self.shape is None:
      return {}
    n = self.count if self.count else float("nan")
    per_member = {"prec@1": self.member_sums["prec@1"] / n, "nll": self.member_sums["nll"] / n,
                  "ece": np.array([c.result()["ece"] for c in self.calibration])}
    out = {f"{prefix}/member_{m}/{name}": float(value)
           for name, values in per_member.items() for m, value in enumerate(values)}
    for name, values in per_member.items():
      out[f"{prefix}/member_mean/{name}"] = float(np.mean(values))
    if self.shape[0] >= 2:
      for name, total in self.diversity_sums.items():
        out[f"{prefix}/diversity/{name}"] = total / n
      ensemble_error = 1.0 - self.ensemble_correct / n
      out[f"{prefix}/diversity/normalized_disagreement"] = (
          out[f"{prefix}/diversity/disagreement"] / (ensemble_error + _DISAGREEMENT_EPS))
    return out

  def kept(self) -> np.ndarray:
    """(M, N, C) float32 member probabilities of every real row in order (needs keep=True)."""
    if not self.keep:
      raise ValueError("EnsembleStats(keep=True) is needed to keep member probabilities")
    num_members, num_classes = self.shape or (0, 0)
    if not self._kept:
      return np.zeros((num_members, 0, num_classes), np.float32)
    return np.concatenate(self._kept).transpose(1, 0, 2)


def _kl_terms(p, q):
  """Σ_c p log(p / q) (last axis); a zero p adds 0, a zero q under a positive p is floored."""
  positive = p > 0
  log_p = np.log(np.where(positive, p, 1.0))
  return np.where(positive, p * (log_p - np.log(np.maximum(q, _EPS))), 0.0).sum(-1)
