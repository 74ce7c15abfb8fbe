"""Expected calibration error (Guo et al. 2017) with equal-width bins, accumulated batch by batch:
only per-bin sums are kept, so evaluating a large split keeps memory flat."""
from __future__ import annotations

import numpy as np

from runner.evaluators.figures import new_figure, save_png


class CalibrationAccumulator:
  """Per-bin counts, summed confidence and summed correctness over the real rows seen so far.
  Bin i is (i/B, (i+1)/B]; a confidence of exactly 0 goes in the first bin."""

  def __init__(self, num_bins: int = 15):
    if num_bins < 1:
      raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    self.num_bins = num_bins
    # i / B rather than linspace: i * (1 / B) can be one ulp off, and a confidence that is exactly
    # a bin edge must land in the bin below it.
    self.bin_edges = np.arange(num_bins + 1) / num_bins
    self.bin_counts = np.zeros(num_bins, np.int64)
    self.confidence_sums = np.zeros(num_bins, np.float64)
    self.correct_sums = np.zeros(num_bins, np.float64)

  def update(self, probs: np.ndarray, labels: np.ndarray, mask: np.ndarray | None = None) -> None:
    """probs (N, C) predicted probabilities; labels (N, C) one-hot or multi-hot; mask (N,) bool of
    real rows. confidence = max prob; correct = labels[row, argmax] > 0 (multi-label aware, like
    precision@1)."""
    probs, labels = np.asarray(probs), np.asarray(labels)
    if mask is not None:
      mask = np.asarray(mask, bool)
      probs, labels = probs[mask], labels[mask]
    top = np.argmax(probs, axis=-1)
    confidence = np.take_along_axis(probs, top[:, None], axis=-1)[:, 0]
    correct = np.take_along_axis(labels, top[:, None], axis=-1)[:, 0] > 0
    # Edges in the confidence's own dtype, so float32(0.2) counts as exactly on the edge 1/5.
    edges = self.bin_edges.astype(confidence.dtype) if confidence.dtype.kind == "f" else self.bin_edges
    bins = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, self.num_bins - 1)
    self.bin_counts += np.bincount(bins, minlength=self.num_bins)
    self.confidence_sums += np.bincount(bins, confidence.astype(np.float64), minlength=self.num_bins)
    self.correct_sums += np.bincount(bins, correct.astype(np.float64), minlength=self.num_bins)

  def result(self) -> dict:
    """ECE and the per-bin statistics a reliability diagram needs. Empty bins have count 0 and
    NaN confidence/accuracy; ece = sum_b (n_b / N) |accuracy_b - confidence_b| over non-empty bins
    (NaN before any example is seen)."""
    counts = self.bin_counts
    num_examples = int(counts.sum())
    with np.errstate(invalid="ignore", divide="ignore"):
      confidence = np.where(counts > 0, self.confidence_sums / counts, np.nan)
      accuracy = np.where(counts > 0, self.correct_sums / counts, np.nan)
    gaps = np.abs(accuracy - confidence)[counts > 0]
    ece = float(np.sum(counts[counts > 0] * gaps) / num_examples) if num_examples else float("nan")
    return {"ece": ece, "num_examples": num_examples, "bin_edges": self.bin_edges.copy(),
            "bin_counts": counts.copy(), "bin_confidence": confidence, "bin_accuracy": accuracy}


def plot_reliability_diagram(result: dict, path: str, title: str = "") -> str:
  """Writes a PNG reliability diagram of a `CalibrationAccumulator.result()` and returns the path:
  accuracy per confidence bin against the diagonal of perfect calibration, and bin counts as a
  light histogram on a second axis."""
  edges = np.asarray(result["bin_edges"])
  counts = np.asarray(result["bin_counts"])
  accuracy = np.nan_to_num(np.asarray(result["bin_accuracy"], np.float64))
  lefts, widths = edges[:-1], np.diff(edges)

  figure = new_figure(5, 5)
  axes = figure.add_subplot()
  count_axes = axes.twinx()
  count_axes.bar(lefts, counts, width=widths, align="edge", color="tab:gray", alpha=0.2,
                 label="examples per bin")
  count_axes.set_ylabel("examples per bin")
  axes.set_zorder(count_axes.get_zorder() + 1)  # accuracy bars in front of the histogram
  axes.patch.set_visible(False)
  axes.bar(lefts, accuracy, width=widths, align="edge", color="tab:blue", edgecolor="black",
           alpha=0.8, label="accuracy")
  axes.plot([0, 1], [0, 1], linestyle="--", color="tab:red", label="perfect calibration")
  axes.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accuracy")
  axes.legend(loc="upper left")
  heading = f"ECE = {result['ece']:.4f} (N = {result['num_examples']})"
  axes.set_title(f"{title}\n{heading}" if title else heading)
  return save_png(figure, path)
