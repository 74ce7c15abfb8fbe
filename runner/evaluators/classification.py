"""Precision@1, NLL and the training loss on a split; jitted sums, aggregated in Python."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from runner.train.losses import LOSSES, precision_at_1, softmax_xent


def make_eval_step(model, loss_name: str = "softmax_xent"):
  """(params, batch) -> sums over the real (unpadded) examples of the batch."""
  loss_fn = LOSSES[loss_name]

  def step(params, batch):
    logits, extras = model.apply({"params": params}, batch["image"], train=False)
    mask = batch["_mask"].astype(jnp.float32)
    labels = batch["labels"]
    # NLL of the model's own likelihood: categorical for softmax models, Bernoulli per class
    # for sigmoid (multi-label) models.
    nll = softmax_xent(logits, labels) if loss_name == "softmax_xent" else loss_fn(logits, labels)
    sums = {"prec@1": precision_at_1(logits, labels), "nll": nll, "loss": loss_fn(logits, labels)}
    out = {k: jnp.sum(v * mask) for k, v in sums.items()}
    out["count"] = jnp.sum(mask)
    for layer, metrics in extras["routing"].items():
      out[f"moe/{layer}/fraction_dropped_tokens"] = metrics["fraction_dropped_tokens"] * mask.sum()
    return out
  return step


class ClassificationEvaluator:
  """Evaluates parameters on one split; `put` places a host batch on the devices."""

  def __init__(self, step, batches, *, prefix: str, put=lambda batch: batch):
    """`step` is a jitted `make_eval_step(...)`, shared by evaluators of the same model."""
    self.step = step
    self.batches = batches  # a re-iterable dataset of padded numpy batches
    self.prefix = prefix
    self.put = put

  def run(self, params) -> dict:
    totals: dict[str, float] = {}
    start = time.perf_counter()
    for batch in self.batches.as_numpy_iterator():
      sums = jax.device_get(self.step(params, self.put(batch)))
      for k, v in sums.items():
        totals[k] = totals.get(k, 0.0) + float(v)
    count = max(totals.pop("count", 0.0), 1.0)
    seconds = time.perf_counter() - start
    out = {f"{self.prefix}/{k}": v / count for k, v in totals.items()}
    out[f"{self.prefix}/images_per_s"] = count / seconds if seconds else np.nan
    return out
