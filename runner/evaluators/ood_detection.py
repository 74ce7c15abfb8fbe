"""Out-of-distribution detection (`eval.ood_datasets`): each OOD dataset against the first eval
dataset, by maximum softmax probability, max logit, entropy and Mahalanobis distance of the
pre-logits (class means and a tied covariance fitted on the in-distribution training split).
The metrics themselves are in runner/evaluators/ood.py."""
from __future__ import annotations

import dataclasses
from typing import List

from runner.config.checks import Items, key
from runner.evaluators import predictions, suite as suite_lib
from runner.evaluators.ood import SCORES, detection_metrics


@dataclasses.dataclass
class OodKeys:
  ood_datasets: List[str] = key([], Items(unique=True), "each vs the first eval dataset")


class Evaluator(suite_lib.Evaluator):
  name = "ood"
  enabling_key = "eval.ood_datasets"
  Keys = OodKeys

  def run(self) -> suite_lib.Result:
    s = self.suite
    keep = bool(getattr(s.config, "save_predictions", False))
    in_dist = s.in_distribution
    fit = predictions.fit_mahalanobis(s.step, s.params, s.batches(in_dist, in_dist.config.split),
                                      in_dist.source.num_classes, put=s.placement.put)
    result = suite_lib.Result()
    result.summary[f"{in_dist.name}/mahalanobis_fit_examples"] = int(fit.class_counts.sum())
    if fit.unreliable():
      s.warn(fit.unreliable())
    stats = predictions.PredictionStats(loss_name=s.loss_name, scores=True, mahalanobis=fit)
    s.evaluate(s.batches(in_dist), stats, f"OOD scores of {in_dist.name}/{in_dist.split}")
    in_scores = stats.score_arrays()
    if keep:
      result.arrays.update({f"{in_dist.name}/score_{k}": v for k, v in in_scores.items()})
    for ood in s.ood:
      stats = predictions.PredictionStats(loss_name=s.loss_name, scores=True, mahalanobis=fit,
                                          labelled=False)
      s.evaluate(s.batches(ood), stats, f"OOD {ood.name}/{ood.split}")
      out_scores = stats.score_arrays()
      for score in SCORES:
        for k, v in detection_metrics(in_scores[score], out_scores[score]).items():
          result.summary[f"{in_dist.name}_vs_{ood.name}/{score}/{k}"] = v
      if keep:
        result.arrays.update({f"{ood.name}/score_{k}": v for k, v in out_scores.items()})
    return result
