"""One pass of a model over a split, and everything measured from its per-example predictions.

The jitted step returns logits and pre-logits; the host folds each batch into running sums
(precision@1, NLL, Brier, calibration bins) and keeps only what is one number per example (the OOD
scores), so memory stays flat as the split grows. Full probabilities are kept only on request
(`keep_probs`, for predictions.npz)."""
from __future__ import annotations

import time
from typing import Iterable

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np

from runner.evaluators.calibration import CalibrationAccumulator
from runner.evaluators.ood import MahalanobisFit, logit_scores
from runner.losses.classification import probabilities
from runner.models import inputs
from runner.models.introspection import apply_with_routing


def make_predict_step(model, hooks: dict | None = None):
  """(params, batch) -> logits and float32 pre-logits of every row (padded rows included), and per
  MoE layer the fraction of real tokens that no expert processed (summed over real rows). For an
  ensemble (a partitioned batch ensemble, or `runner.models.ensemble.Ensemble`) the logits are those
  of the members' mean probability, `member_logits` (B, M, C) the members' own, and the pre-logits
  the members' side by side. `hooks` (name -> an evaluator's `PassHook`) add `hooks[name]`, what
  each hook computes from the routing records of the batch."""
  def step(params, batch):
    images = inputs.images(batch)
    if hooks:
      logits, extras, records = apply_with_routing(model, params, images, train=False)
    else:
      logits, extras = model.apply({"params": params}, images, train=False)
    real = batch["_mask"].astype(jnp.float32).sum()
    dropped = {f"moe/{layer}/fraction_dropped_tokens": m["fraction_dropped_tokens"] * real
               for layer, m in extras["routing"].items()}
    out = {"logits": logits, "pre_logits": extras["pre_logits"], "sums": dropped}
    if "member_logits" in extras:
      out["member_logits"] = extras["member_logits"]
    if hooks:
      out["hooks"] = {name: hook.sums(records, batch, logits) for name, hook in hooks.items()}
    return out
  return step


def to_host(tree):
  """Global arrays as host NumPy; across processes every process gets every row (same order)."""
  if jax.process_count() > 1:
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
  return jax.tree.map(np.asarray, jax.device_get(tree))


def predict_batches(step, params, batches, put=lambda b: b) -> Iterable[dict]:
  """Yields host dicts with logits, pre_logits, labels and mask for each batch of `batches`."""
  for batch in batches.as_numpy_iterator():
    out = to_host(step(params, put(batch)))
    # Each process read its own rows: gathered in the same (process-major) order as the outputs.
    host = to_host({"labels": batch["labels"], "_mask": batch["_mask"]})
    out.update(labels=np.asarray(host["labels"]), mask=np.asarray(host["_mask"], bool))
    yield out


class PredictionStats:
  """Running classification, calibration and OOD statistics of one split. For softmax models: NLL =
  -log p(y) with y the (normalised) label distribution, Brier = sum_c (p_c - y_c)^2. For sigmoid
  (multi-label) models both are sums over classes of the binary terms. Precision@1 counts the top
  class as correct when it is any true label."""

  def __init__(self, *, loss_name: str = "softmax_xent", ece_bins: int = 15, scores: bool = False,
               mahalanobis: MahalanobisFit | None = None, keep_probs: bool = False,
               labelled: bool = True):
    self.loss_name = loss_name
    self.labelled = labelled
    self.calibration = CalibrationAccumulator(ece_bins)
    self.sums = {"prec@1": 0.0, "nll": 0.0, "brier": 0.0}
    self.routing_sums: dict[str, float] = {}
    self.count = 0
    self.want_scores = scores or mahalanobis is not None
    self.mahalanobis = mahalanobis
    self.scores: dict[str, list] = {}
    self.keep_probs = keep_probs
    self.kept: dict[str, list] = {"labels": [], "probs": []}

  def update(self, out: dict) -> None:
    mask = out["mask"]
    if not mask.any():
      return
    for k, v in out.get("sums", {}).items():
      self.routing_sums[k] = self.routing_sums.get(k, 0.0) + float(v)
    logits = np.asarray(out["logits"], np.float64)[mask]
    probs = probabilities(logits, self.loss_name)
    if self.labelled:
      labels = np.asarray(out["labels"], np.float64)[mask]
      top = probs.argmax(axis=-1)
      self.sums["prec@1"] += float(np.sum(labels[np.arange(len(top)), top] > 0))
      if self.loss_name == "sigmoid_xent":
        eps = 1e-12
        nll = -(labels * np.log(np.maximum(probs, eps))
                + (1 - labels) * np.log(np.maximum(1 - probs, eps))).sum(-1)
        target = labels
      else:
        target = labels / np.maximum(labels.sum(-1, keepdims=True), 1e-12)
        log_probs = logits - logits.max(-1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
        nll = -(target * log_probs).sum(-1)
      self.sums["nll"] += float(nll.sum())
      self.sums["brier"] += float(((probs - target) ** 2).sum())
      self.calibration.update(probs, labels)
      if self.keep_probs:
        self.kept["labels"].append(labels.astype(np.float32))
    self.count += int(mask.sum())
    if self.keep_probs:
      self.kept["probs"].append(probs.astype(np.float32))
    if self.want_scores:
      for name, value in logit_scores(logits).items():
        self.scores.setdefault(name, []).append(value)
      if self.mahalanobis is not None:
        features = np.asarray(out["pre_logits"], np.float64)[mask]
        self.scores.setdefault("mahalanobis", []).append(self.mahalanobis.score(features))

  def metrics(self, prefix: str) -> dict[str, float]:
    if not self.labelled:
      return {f"{prefix}/count": self.count}
    n = max(self.count, 1)
    out = {f"{prefix}/{k}": v / n for k, v in self.sums.items()}
    out[f"{prefix}/error"] = 1.0 - out[f"{prefix}/prec@1"]
    out[f"{prefix}/ece"] = self.calibration.result()["ece"]
    out[f"{prefix}/count"] = self.count
    out.update({f"{prefix}/{k}": v / n for k, v in self.routing_sums.items()})
    return out

  def score_arrays(self) -> dict[str, np.ndarray]:
    return {k: np.concatenate(v) for k, v in self.scores.items()}

  def kept_arrays(self) -> dict[str, np.ndarray]:
    return {k: np.concatenate(v) for k, v in self.kept.items() if v}


def run_pass(step, params, batches, stats: PredictionStats | None, put=lambda b: b,
             progress=None, on_batch=None) -> float:
  """Feeds every batch into `stats` (and `on_batch`); returns images/s after the first batch."""
  count, t0, first = 0, None, 0
  for out in predict_batches(step, params, batches, put):
    if stats is not None:
      stats.update(out)
    if on_batch is not None:
      on_batch(out)
    real = int(out["mask"].sum())
    if t0 is None:
      t0, first = time.perf_counter(), real  # the first batch includes compilation
    count += real
    if progress is not None:
      progress(real)
  if t0 is not None and count == first:  # one batch, timed with its compilation: time it again
    batch = next(iter(batches.as_numpy_iterator()))
    start = time.perf_counter()
    to_host(step(params, put(batch)))
    return first / max(time.perf_counter() - start, 1e-9)
  seconds = time.perf_counter() - t0 if t0 is not None else 0.0
  return (count - first) / seconds if seconds > 0 and count > first else float("nan")


def fit_mahalanobis(step, params, batches, num_classes: int, put=lambda b: b) -> MahalanobisFit:
  """Class means and tied covariance of pre-logits over a (training) split."""
  fit = None
  for out in predict_batches(step, params, batches, put):
    features = np.asarray(out["pre_logits"])
    if fit is None:
      fit = MahalanobisFit(num_classes, features.shape[-1])
    fit.update(features, np.asarray(out["labels"]), out["mask"])
  fit.finalize()
  return fit


def xla_flops(step, *args) -> float:
  """FLOPs XLA counts for one call of the jitted `step` on these arguments (nan if unknown)."""
  cost = step.lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float((cost or {}).get("flops", float("nan")))


def zeros_batch_like(batches) -> dict:
  """A batch of zeros with the shapes of `batches` (what cost analysis needs)."""
  first = next(batches.take(1).as_numpy_iterator())
  return {k: np.zeros_like(v) for k, v in first.items()}
