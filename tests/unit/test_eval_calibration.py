"""Expected calibration error against a loop-over-bins NumPy reference and hand-computed values."""
from __future__ import annotations

import numpy as np
import pytest

from runner.evaluators.calibration import CalibrationAccumulator, plot_reliability_diagram


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, num_bins: int = 15) -> float:
  """ECE of one in-memory batch."""
  accumulator = CalibrationAccumulator(num_bins)
  accumulator.update(probs, labels)
  return accumulator.result()["ece"]


def reference_ece(probs: np.ndarray, labels: np.ndarray, num_bins: int) -> float:
  """Guo et al. 2017 from the definition: one pass per bin (i/B, (i+1)/B], 0 in the first bin."""
  confidence = probs.max(axis=1)
  predicted = probs.argmax(axis=1)
  correct = np.array([labels[i, predicted[i]] > 0 for i in range(len(probs))])
  ece = 0.0
  for b in range(num_bins):
    low, high = b / num_bins, (b + 1) / num_bins
    in_bin = (confidence > low) & (confidence <= high)
    if b == 0:
      in_bin |= confidence == 0
    if in_bin.any():
      ece += in_bin.sum() / len(probs) * abs(correct[in_bin].mean() - confidence[in_bin].mean())
  return ece


def random_predictions(rng: np.random.Generator, num_examples: int, num_classes: int):
  logits = rng.normal(size=(num_examples, num_classes)) * rng.uniform(0.5, 4.0)
  probs = np.exp(logits - logits.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)
  # Labels drawn from the predictions, sharpened, so accuracy tracks confidence only roughly.
  classes = np.array([rng.choice(num_classes, p=p) for p in probs ** 2 / (probs ** 2).sum(1, keepdims=True)])
  return probs, np.eye(num_classes)[classes]


@pytest.mark.parametrize("num_bins", [1, 5, 10, 15, 23])
def test_ece_matches_loop_over_bins_reference_on_random_data(num_bins):
  rng = np.random.default_rng(num_bins)
  probs, labels = random_predictions(rng, 500, 7)
  got = expected_calibration_error(probs, labels, num_bins)
  assert got == pytest.approx(reference_ece(probs, labels, num_bins), rel=1e-12, abs=1e-15)
  accumulator = CalibrationAccumulator(num_bins)
  accumulator.update(probs, labels)
  result = accumulator.result()
  assert result["num_examples"] == 500
  assert result["bin_counts"].sum() == 500
  assert result["bin_edges"].shape == (num_bins + 1,)
  for key in ("bin_counts", "bin_confidence", "bin_accuracy"):
    assert result[key].shape == (num_bins,)
  empty = result["bin_counts"] == 0
  assert np.isnan(result["bin_confidence"][empty]).all() and np.isnan(result["bin_accuracy"][empty]).all()
  assert not np.isnan(result["bin_confidence"][~empty]).any()


def test_streaming_in_uneven_masked_chunks_equals_one_shot():
  rng = np.random.default_rng(0)
  probs, labels = random_predictions(rng, 300, 5)
  one_shot = CalibrationAccumulator(10)
  one_shot.update(probs, labels)
  want = one_shot.result()

  streamed = CalibrationAccumulator(10)
  bounds = [0, 1, 64, 65, 200, 300]
  for start, stop in zip(bounds[:-1], bounds[1:]):
    # Each chunk padded with junk rows, as an evaluation batch is, and masked out.
    padding = 7
    chunk_probs = np.concatenate([probs[start:stop], np.tile([[0.9, 0.1, 0, 0, 0]], (padding, 1))])
    chunk_labels = np.concatenate([labels[start:stop], np.zeros((padding, 5))])
    mask = np.arange(len(chunk_probs)) < stop - start
    streamed.update(chunk_probs, chunk_labels, mask)
  got = streamed.result()
  assert got["ece"] == pytest.approx(want["ece"], rel=1e-12)
  assert got["num_examples"] == 300
  np.testing.assert_array_equal(got["bin_counts"], want["bin_counts"])
  np.testing.assert_allclose(got["bin_confidence"], want["bin_confidence"], rtol=1e-12)
  np.testing.assert_allclose(got["bin_accuracy"], want["bin_accuracy"], rtol=1e-12)


def test_perfectly_calibrated_predictions_give_zero():
  # 10 examples at confidence 0.8, 8 of them right; 4 at 0.5, 2 right (5 bins: bins 3 and 2).
  probs = np.array([[0.8, 0.2]] * 10 + [[0.5, 0.5]] * 4)
  labels = np.array([[1, 0]] * 8 + [[0, 1]] * 2 + [[1, 0]] * 2 + [[0, 1]] * 2)
  assert expected_calibration_error(probs, labels, num_bins=5) == pytest.approx(0.0, abs=1e-15)


def test_hand_computed_example():
  # 3 bins. Bin 0 (0, 1/3]: nothing. Bin 1 (1/3, 2/3]: conf 0.4 (wrong), 0.6 (right) -> conf 0.5,
  # acc 0.5, gap 0. Bin 2 (2/3, 1]: conf 0.9 (wrong), 0.7 (right), 1.0 (right) -> conf 13/15,
  # acc 2/3, gap 0.2. ECE = 3/5 * 0.2 = 0.12.
  probs = np.array([[0.4, 0.35, 0.25], [0.6, 0.4, 0.0], [0.05, 0.9, 0.05], [0.1, 0.2, 0.7],
                    [0.0, 0.0, 1.0]])
  labels = np.array([[0, 1, 0], [1, 0, 0], [1, 0, 0], [0, 0, 1], [0, 0, 1]])
  accumulator = CalibrationAccumulator(3)
  accumulator.update(probs, labels)
  result = accumulator.result()
  assert result["ece"] == pytest.approx(0.12, abs=1e-12)
  np.testing.assert_array_equal(result["bin_counts"], [0, 2, 3])
  np.testing.assert_allclose(result["bin_confidence"][1:], [0.5, 13 / 15])
  np.testing.assert_allclose(result["bin_accuracy"][1:], [0.5, 2 / 3])
  np.testing.assert_allclose(result["bin_edges"], [0, 1 / 3, 2 / 3, 1])


def test_multi_hot_labels_count_any_true_class_at_the_argmax():
  probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
  labels = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1]])  # right, wrong, right
  accumulator = CalibrationAccumulator(10)
  accumulator.update(probs, labels)
  result = accumulator.result()
  filled = result["bin_counts"] > 0
  np.testing.assert_allclose(result["bin_confidence"][filled], [0.4, 0.7, 0.8])
  np.testing.assert_array_equal(result["bin_accuracy"][filled], [1.0, 1.0, 0.0])
  want = (0.6 + 0.3 + 0.8) / 3
  assert result["ece"] == pytest.approx(want, rel=1e-12)
  assert result["ece"] == pytest.approx(reference_ece(probs, labels, 10), rel=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_confidence_on_a_bin_edge_goes_to_the_bin_below(dtype):
  # 5 bins: 0.2 -> bin 0 (0, 0.2]; 0.6 -> bin 2 (0.4, 0.6]; 1.0 -> bin 4; 0 -> bin 0.
  probs = np.array([[0.2, 0.2], [0.6, 0.4], [1.0, 0.0], [0.0, 0.0]], dtype)
  labels = np.array([[1, 0], [1, 0], [1, 0], [0, 1]])
  accumulator = CalibrationAccumulator(5)
  accumulator.update(probs, labels)
  np.testing.assert_array_equal(accumulator.result()["bin_counts"], [2, 0, 1, 0, 1])
  for edge_bin in range(1, 5):  # every interior edge i/5 lands in bin i - 1
    accumulator = CalibrationAccumulator(5)
    accumulator.update(np.array([[edge_bin / 5]], dtype), np.ones((1, 1)))
    assert accumulator.result()["bin_counts"].argmax() == edge_bin - 1


def test_no_examples_gives_nan_ece():
  accumulator = CalibrationAccumulator(4)
  accumulator.update(np.array([[0.5, 0.5]]), np.array([[1, 0]]), mask=np.array([False]))
  result = accumulator.result()
  assert result["num_examples"] == 0 and np.isnan(result["ece"])


def test_reliability_diagram_is_a_png(tmp_path):
  rng = np.random.default_rng(3)
  probs, labels = random_predictions(rng, 200, 4)
  accumulator = CalibrationAccumulator(15)  # some bins empty (confidence >= 1/4)
  accumulator.update(probs, labels)
  path = plot_reliability_diagram(accumulator.result(), str(tmp_path / "reliability.png"),
                                  title="test split")
  assert path == str(tmp_path / "reliability.png")
  data = (tmp_path / "reliability.png").read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  assert len(data) > 5_000
