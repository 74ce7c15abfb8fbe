"""Linear few-shot evaluation of frozen features, shared by `vmoe fewshot` and training.

Padded eval batches stream through one or more feature extractors (jitted batch -> pre-logits);
their features are concatenated per image, so an ensemble is probed as one representation. The ridge
classifiers, shot sampling and L2 selection are `fewshot_math`'s."""
from __future__ import annotations

import re
import time
from typing import Callable, Iterable, Sequence

import jax
import numpy as np

from runner.config.preprocessing import DEVICE_VALUE_RANGE
from runner.evaluators import fewshot_math
from runner.evaluators.figures import new_figure, save_png
from runner.evaluators.predictions import to_host
from runner.logging import Progress
from runner.models import inputs

_ACCURACY_KEY = re.compile(r"^(?P<name>.+)/(?P<shots>\d+)shot/accuracy$")


def make_feature_fn(model) -> Callable:
  """(params, batch) -> pre-logits of the batch's images in eval mode: the representation a
  linear probe sees."""
  def features(params, batch):
    _, extras = model.apply({"params": params}, inputs.images(batch), train=False)
    return extras["pre_logits"]
  return features


def _num_batches(batches) -> int:
  try:
    return int(batches.cardinality()) if hasattr(batches, "cardinality") else len(batches)
  except TypeError:
    return -1


def extract_features(feature_fns: Sequence[Callable], batches: Iterable[dict],
                     put: Callable = lambda batch: batch, *,
                     progress: Progress | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(features (N, D1 + D2 + ...) float32, labels (N,) int64) of the real rows of `batches`:
  padded eval batches (`image`, one-hot `labels`, `_mask` marking real rows), a tf.data dataset or
  any iterable of dicts; `put` places a host batch on the devices. Each extractor's output is
  flattened per image and the extractors' features are concatenated in order. Rows come back in
  the split's order whatever the number of processes (each reads a contiguous share), so the
  shots drawn from them do not depend on it. The next batch is dispatched before the previous one
  is fetched: host copies overlap compute."""
  if not feature_fns:
    raise ValueError("extract_features needs at least one feature function")
  features, keys = [], []
  seen = 0  # real rows this process has read so far

  def fetch(pending):
    outs, rows = to_host(pending)
    keep = rows["_mask"].astype(bool)
    flat = [np.asarray(o, np.float32).reshape(len(o), -1) for o in outs]
    features.append(np.concatenate(flat, axis=1)[keep])
    keys.append(np.stack([rows["_process"], rows["_position"], rows["labels"]], axis=1)[keep])

  pending = None
  batches = batches.as_numpy_iterator() if hasattr(batches, "as_numpy_iterator") else batches
  for i, batch in enumerate(batches):
    mask = np.asarray(batch["_mask"], bool)
    position = seen + np.cumsum(mask) - 1
    seen += int(mask.sum())
    images = {k: v for k, v in batch.items() if k in ("image", DEVICE_VALUE_RANGE)}
    placed = put({**images, "labels": np.argmax(batch["labels"], axis=-1).astype(np.int32),
                  "_mask": mask, "_position": position.astype(np.int32),
                  "_process": np.full(len(mask), jax.process_index(), np.int32)})
    outs = [fn({k: placed[k] for k in images}) for fn in feature_fns]
    if pending is not None:
      fetch(pending)
    pending = (outs, {k: v for k, v in placed.items() if k not in images})
    if progress is not None:
      progress.step_done(i + 1)
  if pending is not None:
    fetch(pending)
  if not features:
    return np.zeros((0, 0), np.float32), np.zeros((0,), np.int64)
  features, keys = np.concatenate(features), np.concatenate(keys).astype(np.int64)
  order = np.lexsort((keys[:, 1], keys[:, 0]))  # by process, then position within its share
  return features[order], keys[order, 2]


class FewshotEvaluator:
  """Few-shot accuracy on several datasets, from features extracted afresh at every `run`.
  datasets[name] = (train_batches, test_batches, num_classes): the pool the shots are drawn from
  and the test split, as padded eval batches; `protocol`: fewshot_math's. Returns its keys, under
  `prefix/` if any: `<name>/<s>shot/accuracy`, `mean/<s>shot/accuracy`, `mean/<s>shot/l2_reg`."""

  def __init__(self, feature_fns: Sequence[Callable] | None, datasets: dict[str, tuple],
               shots: Sequence[int] = (1, 5, 10, 25), seeds: Sequence[int] = (0, 1, 2),
               l2_regs=None, put: Callable = lambda batch: batch, *, prefix: str = "",
               progress: bool = False, protocol="reference"):
    if not datasets:
      raise ValueError("FewshotEvaluator needs at least one dataset")
    self.feature_fns = list(feature_fns or [])
    self.datasets = dict(datasets)
    self.shots = [int(s) for s in shots]
    self.seeds = [int(s) for s in seeds]
    self.l2_regs = fewshot_math.L2_REGS if l2_regs is None else np.asarray(l2_regs, np.float64)
    self.protocol = fewshot_math.protocol_name(protocol)
    self.put, self.prefix, self.progress = put, prefix, progress

  def features(self, feature_fns: Sequence[Callable] | None = None) -> dict[str, tuple]:
    """name -> (train_x, train_y, test_x, test_y, num_classes), as fewshot_metrics takes them."""
    fns = list(feature_fns) if feature_fns is not None else self.feature_fns
    out = {}
    for name, (train_batches, test_batches, num_classes) in self.datasets.items():
      arrays = []
      for split, batches in (("train", train_batches), ("test", test_batches)):
        progress = Progress(max(_num_batches(batches), 1), 0, 1, desc=f"features {name} {split}",
                            enabled=self.progress)
        try:
          arrays += extract_features(fns, batches, self.put, progress=progress)
        finally:
          progress.close()
      out[name] = (*arrays, int(num_classes))
    return out

  def run(self, feature_fns: Sequence[Callable] | None = None) -> dict[str, float]:
    """Metrics of `feature_fns` (default: the constructor's); training passes its current params."""
    start = time.perf_counter()
    metrics = fewshot_math.fewshot_metrics(self.features(feature_fns), self.shots, self.seeds,
                                           self.l2_regs, protocol=self.protocol)
    metrics["seconds"] = time.perf_counter() - start
    return {f"{self.prefix}/{k}" if self.prefix else k: v for k, v in metrics.items()}


def accuracy_table(metrics: dict) -> tuple[list[str], list[int], np.ndarray]:
  """(dataset names with `mean` last, shots ascending, accuracies [name, shots]; NaN if absent)."""
  found = {(match["name"], int(match["shots"])): float(value) for key, value in metrics.items()
           if (match := _ACCURACY_KEY.match(key))}
  names = sorted(dict.fromkeys(name for name, _ in found), key=lambda name: name == "mean")
  shots = sorted({s for _, s in found})
  table = np.array([[found.get((n, s), np.nan) for s in shots] for n in names]).reshape(
      len(names), len(shots))
  return names, shots, table


def format_table(metrics: dict) -> str:
  """Accuracies as a plain-text table: one row per dataset (and the mean), one column per shots."""
  names, shots, table = accuracy_table(metrics)
  width = max([len("dataset")] + [len(n) for n in names])
  lines = [f"{'dataset':<{width}}  " + "  ".join(f"{f'{s}-shot':>7}" for s in shots)]
  for name, row in zip(names, table):
    lines.append(f"{name:<{width}}  " + "  ".join(f"{v:>7.4f}" for v in row))
  return "\n".join(lines)


def plot_accuracy_vs_shots(metrics: dict, path: str, title: str = "") -> str:
  """Writes a PNG of accuracy against shots per class, one line per dataset (mean dashed)."""
  names, shots, table = accuracy_table(metrics)
  figure = new_figure(6, 4.5)
  axes = figure.add_subplot()
  for name, row in zip(names, table):
    style = dict(linestyle="--", color="black") if name == "mean" else {}
    axes.plot(shots, row, marker="o", label=name, **style)
  if len(shots) > 1:
    axes.set_xscale("log")
  axes.set_xticks(shots)
  axes.set_xticklabels([str(s) for s in shots])
  axes.set(ylim=(0, 1), xlabel="shots per class", ylabel="test accuracy")
  axes.grid(True, alpha=0.3)
  axes.legend(loc="lower right")
  axes.set_title(title or "linear few-shot accuracy (ridge on frozen pre-logits)")
  return save_png(figure, path)
