"""Classification on a split: the training loop's evaluator, which folds the sums of the eval step
(runner/train/step.py: precision@1, NLL, the training loss) into means, and the `vmoe eval`
evaluator (prec@1, NLL, Brier, ECE; members and diversity for an ensemble)."""
from __future__ import annotations

import dataclasses
import re
import time

import jax
import numpy as np

from runner.config import derived
from runner.config.checks import at_least, key
from runner.evaluators import suite as suite_lib
from runner.evaluators.calibration import plot_reliability_diagram
from runner.evaluators.ensemble import EnsembleStats
from runner.evaluators.predictions import PredictionStats
from runner.losses.classification import probabilities


class ClassificationEvaluator:
  """Evaluates parameters on one split (`batches`, a re-iterable dataset of padded numpy
  batches); `step` is a jitted `runner.train.step.make_eval_step(...)`, shared by evaluators of
  the same model, and `run`'s further arguments follow the batch into it; `put` places a host
  batch on the devices."""

  def __init__(self, step, batches, *, prefix: str, put=lambda batch: batch):
    self.step, self.batches, self.prefix, self.put = step, batches, prefix, put

  def run(self, params, *args) -> dict:
    totals: dict[str, float] = {}
    start = time.perf_counter()
    for batch in self.batches.as_numpy_iterator():
      sums = jax.device_get(self.step(params, self.put(batch), *args))
      for k, v in sums.items():
        totals[k] = totals.get(k, 0.0) + float(v)
    count = max(totals.pop("count", 0.0), 1.0)
    seconds = time.perf_counter() - start
    out = {f"{self.prefix}/{k}": v / count for k, v in totals.items()}
    out[f"{self.prefix}/images_per_s"] = count / seconds if seconds else np.nan
    return out


class _EnsembleStats(PredictionStats):
  """The ensemble's prediction, plus its members' own metrics and their diversity
  (runner/evaluators/ensemble.py)."""

  def __init__(self, *, output: str, keep_members: bool = False, **kwargs):
    super().__init__(**kwargs)
    self.members = EnsembleStats(num_bins=self.calibration.num_bins, output=output,
                                 keep=keep_members)

  def update(self, out: dict) -> None:
    super().update(out)
    if out["mask"].any():
      probs = probabilities(out["member_logits"], self.loss_name)
      self.members.update(probs, out["labels"], out["mask"])

  def metrics(self, prefix: str) -> dict[str, float]:
    return {**super().metrics(prefix), **self.members.metrics(prefix)}


@dataclasses.dataclass
class ClassificationKeys:
  """eval.ece_bins: the calibration error's bins, which the corruptions' ECE uses too."""
  ece_bins: int = key(15, at_least(1))


class Evaluator(suite_lib.Evaluator):
  """prec@1, error, NLL, Brier, ECE (and a reliability diagram) on every eval dataset; for an
  ensemble also each member's metrics and the members' diversity. Each dataset's pass is its
  main pass, which other evaluators ride (`Suite.main_pass`); the first one's speed is
  `compute/images_per_s`."""
  name = "classification"
  in_training = False  # the training loop measures it itself (ClassificationEvaluator)
  Keys = ClassificationKeys

  def run(self) -> suite_lib.Result:
    s, e = self.suite, self.suite.config
    result = suite_lib.Result()
    ensemble = s.members is not None and s.members.size > 1
    keep = bool(getattr(e, "save_predictions", False))
    for i, ds in enumerate(s.datasets):
      kwargs = dict(loss_name=s.loss_name, ece_bins=e.ece_bins, keep_probs=keep)
      stats = (_EnsembleStats(output=derived.model_output(s.loss_name), keep_members=keep, **kwargs)
               if ensemble else PredictionStats(**kwargs))
      rate = s.main_pass(ds, stats, first=i == 0)
      result.summary.update(stats.metrics(ds.name))
      result.summary[f"{ds.name}/split"] = ds.split
      result.summary[f"{ds.name}/images_per_s"] = rate
      s.shared.setdefault("metrics", {})[ds.name] = stats.metrics("")
      if i == 0:
        result.summary["compute/images_per_s"] = rate
      if s.plots:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", ds.name)
        path = s.path(f"reliability_{name}.png")
        result.images[f"{ds.name}/reliability"] = plot_reliability_diagram(
            stats.calibration.result(), path, title=f"{ds.name} ({ds.split})")
      if keep:
        result.arrays.update({f"{ds.name}/{k}": v for k, v in stats.kept_arrays().items()})
        if ensemble:
          result.arrays[f"{ds.name}/member_probs"] = stats.members.kept()
    return result
