"""Per-class accuracy: an evaluator written outside vmoe and loaded with `plugins=`.

Copy this file into the folder you run vmoe from and turn it on:

  vmoe eval plugins=[per_class_accuracy] init.checkpoint=<run> eval.per_class_accuracy.enabled=true

The same two overrides work with `vmoe ensemble` (it then measures the ensemble's prediction)
and with `vmoe pretrain` / `vmoe finetune` (the validation split every eval.every_steps and at
the end, logged under val/). For every eval dataset it adds to summary.json:

  <dataset>/per_class_accuracy/<class>       the fraction of the class's images predicted as it
  <dataset>/per_class_accuracy/balanced      their mean over the classes present
  <dataset>/per_class_accuracy/worst_mean    the mean of the eval.per_class_accuracy.top_k_worst
                                             lowest

and, where the run draws plots, a bar chart per dataset (a W&B image); with
eval.save_predictions=true the accuracies also go to predictions.npz.

It costs no forward pass of its own in vmoe eval: it reads the predictions of the main pass that
measures classification (`reader`). In training the loop measures classification itself, so the
suite passes over the validation split for it (`suite.reader_passes`). A dataset's class is the
argmax of its label vector (the first label of a multi-label image).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from runner.config.checks import at_least, key
from runner.evaluators import Dataset, Evaluator, Result, register


@dataclasses.dataclass
class PerClassAccuracyConfig:
  """eval.per_class_accuracy.*: registering the evaluator adds these keys to the schema, so a bad
  value fails before any compute, like a built-in key."""
  enabled: bool = False
  top_k_worst: int = key(3, at_least(1), "the lowest classes averaged into worst_mean")


@register
class PerClassAccuracy(Evaluator):
  """Accuracy within each class (its recall): where an average hides a class the model fails."""
  name = "per_class_accuracy"
  enabling_key = "eval.per_class_accuracy.enabled"
  in_training = True  # cheap enough to follow training
  on_contrastive = True  # a contrastive checkpoint evaluated zero-shot predicts classes too
  needs_labels = True
  Config = PerClassAccuracyConfig

  def __init__(self, suite):
    super().__init__(suite)
    self.correct: dict[str, np.ndarray] = {}  # dataset -> images predicted right, per class
    self.total: dict[str, np.ndarray] = {}  # dataset -> images, per class

  def reader(self):
    return self.count

  def count(self, dataset: Dataset, out: dict) -> None:
    """One batch of a pass: `logits` and one-hot `labels` (B, C), `mask` (B,) of real images."""
    num_classes = out["labels"].shape[-1]
    truth = out["labels"][out["mask"]].argmax(-1)
    predicted = out["logits"][out["mask"]].argmax(-1)
    total = self.total.setdefault(dataset.name, np.zeros(num_classes, np.int64))
    correct = self.correct.setdefault(dataset.name, np.zeros(num_classes, np.int64))
    total += np.bincount(truth, minlength=num_classes)
    correct += np.bincount(truth[predicted == truth], minlength=num_classes)

  def run(self) -> Result:
    s, config = self.suite, self.suite.config.per_class_accuracy
    s.reader_passes(self.name)  # the datasets no main pass covered (all of them in training)
    result = Result()
    for ds in s.datasets:
      total, correct = self.total[ds.name], self.correct[ds.name]
      names = ds.source.class_names or [str(c) for c in range(len(total))]
      present = np.flatnonzero(total)
      accuracy = correct[present] / total[present]
      prefix = f"{ds.name}/per_class_accuracy"
      for c, value in zip(present, accuracy):
        result.summary[f"{prefix}/{names[c]}"] = float(value)
      result.summary[f"{prefix}/balanced"] = float(accuracy.mean())
      worst = np.argsort(accuracy, kind="stable")[:config.top_k_worst]
      result.summary[f"{prefix}/worst_mean"] = float(accuracy[worst].mean())
      s.say(f"[eval] {ds.name}: worst classes "
            + ", ".join(f"{names[present[i]]} {accuracy[i]:.3f}" for i in worst))
      if s.config.save_predictions:
        result.arrays[prefix] = np.where(total > 0, correct / np.maximum(total, 1), np.nan)
      if s.plots:
        path = s.path(f"per_class_accuracy_{re.sub(r'[^A-Za-z0-9_.-]+', '_', ds.name)}.png")
        result.images[prefix] = _bar_chart([names[c] for c in present], accuracy, path, ds.name)
    return result


def _bar_chart(names: list[str], accuracy: np.ndarray, path: str, title: str) -> str:
  """A PNG of one bar per class; a bare Agg figure, so no global plotting state changes."""
  # lazily: matplotlib is slow to import, and only a run that draws needs it
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  figure = Figure(figsize=(max(4, 0.4 * len(names)), 3), dpi=100)
  FigureCanvasAgg(figure)
  axes = figure.add_subplot()
  axes.bar(range(len(names)), accuracy, tick_label=names, color="tab:blue")
  axes.set_ylim(0, 1)
  axes.set_ylabel("accuracy")
  axes.set_title(f"{title}: per-class accuracy")
  figure.tight_layout()
  figure.savefig(path, format="png")
  return path
