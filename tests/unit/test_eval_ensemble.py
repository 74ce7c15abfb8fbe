"""Ensemble combination and metrics against hand-computed vectors (written out below) and a
loop-based NumPy reference. The prediction is the members' mean probability, as for the
ensembles of "Sparse MoEs meet Efficient Ensembles" (Allingham et al.); the per-member metrics
and the pairwise diversity scores are the summary keys docs/ensembles.md lists."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.evaluators.calibration import CalibrationAccumulator
from runner.evaluators.ensemble import EnsembleStats
from runner.models.ensemble import combine_logits


def softmax(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def sigmoid(logits):
  return 1 / (1 + np.exp(-logits))


def as_members(rows, num_members):
  """Rows are image-major, member-minor (row r = b·M + m): the member view is (B, M, ...)."""
  rows = np.asarray(rows)
  return rows.reshape(len(rows) // num_members, num_members, *rows.shape[1:])


# --- combine_logits ------------------------------------------------------------------------------

def test_combined_softmax_is_the_mean_member_probability():
  rng = np.random.default_rng(0)
  z = rng.normal(size=(6, 3, 5)) * 3
  got = softmax(np.asarray(combine_logits(z), np.float64))
  np.testing.assert_allclose(got, softmax(z).mean(1), atol=1e-6)


def test_combined_sigmoid_is_the_mean_member_probability():
  rng = np.random.default_rng(1)
  z = rng.normal(size=(6, 3, 5)) * 3
  got = sigmoid(np.asarray(combine_logits(z, "sigmoid"), np.float64))
  np.testing.assert_allclose(got, sigmoid(z).mean(1), atol=1e-6)


def test_combine_logits_is_jit_compatible_and_takes_numpy():
  z = np.random.default_rng(2).normal(size=(4, 2, 3)).astype(np.float32)
  eager = combine_logits(z)
  jitted = jax.jit(combine_logits, static_argnames="output")(jnp.asarray(z))
  assert eager.shape == jitted.shape == (4, 3)
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-6)
  jitted_sigmoid = jax.jit(lambda x: combine_logits(x, "sigmoid"))(z)
  np.testing.assert_allclose(np.asarray(jitted_sigmoid), np.asarray(combine_logits(z, "sigmoid")),
                             atol=1e-6)


def test_combine_logits_rejects_unknown_output():
  with pytest.raises(ValueError, match="softmax"):
    combine_logits(np.zeros((1, 2, 3)), "mean")


# Hand-computed: logits = log p; the last row is unnormalised ([.6, .3] -> [2/3, 1/3] after
# log_softmax).
LABEL_P = np.array([[.1, .9], [.8, .2], [.3, .7], [.6, .3]])


@pytest.mark.parametrize("num_members, want", [(1, [1, 0, 1, 0]), (2, [1, 1]), (4, [1])])
def test_label_prediction_is_argmax_of_combined_logits(num_members, want):
  combined = combine_logits(as_members(np.log(LABEL_P), num_members))
  np.testing.assert_array_equal(np.argmax(np.asarray(combined), -1), want)


def test_label_prediction_mean_probabilities_match_hand_computed():
  p_bar = softmax(np.asarray(combine_logits(as_members(np.log(LABEL_P), 2)), np.float64))
  np.testing.assert_allclose(p_bar, [[.45, .55], [.48333333, .51666667]], atol=1e-6)
  p_bar = softmax(np.asarray(combine_logits(as_members(np.log(LABEL_P), 4)), np.float64))
  np.testing.assert_allclose(p_bar, [[.46666667, .53333333]], atol=1e-6)


# Hand-computed: eval loss per image = -log of the ensemble's mean probability of the label.
LOSS_P = np.array([[.1, .9], [.2, .8], [.3, .7], [.4, .6]])


@pytest.mark.parametrize("num_members, labels, want", [
    (1, [0, 1, 0, 1], -np.log([.1, .8, .3, .6])),
    (2, [0, 1], [1.897120, 0.430783]),
    (4, [1], [0.287682]),
])
def test_softmax_eval_nll_per_image(num_members, labels, want):
  combined = np.asarray(combine_logits(as_members(np.log(LOSS_P), num_members)), np.float64)
  log_p_bar = combined - np.log(np.exp(combined).sum(-1, keepdims=True))
  nll = -(np.eye(2)[labels] * log_p_bar).sum(-1)
  np.testing.assert_allclose(nll, want, atol=1e-6)


@pytest.mark.parametrize("num_members, labels, want", [
    (1, [0, 1, 0, 1], -np.log([.9, .2, .7, .4])),
    (2, [0, 1], -np.log([.85, .35])),
    (4, [1], -np.log([.25])),
])
def test_sigmoid_eval_nll_per_image(num_members, labels, want):
  p = np.array([.1, .2, .3, .4])
  logits = (np.log(p) - np.log(1 - p))[:, None]  # one class
  combined = np.asarray(combine_logits(as_members(logits, num_members), "sigmoid"), np.float64)
  y = np.asarray(labels, np.float64)[:, None]
  nll = -(y * np.log(sigmoid(combined)) + (1 - y) * np.log(sigmoid(-combined))).sum(-1)
  np.testing.assert_allclose(nll, want, atol=1e-6)


# --- EnsembleStats on a hand-computed vector (P1, P2, Y below) -----------------------------------

P1 = np.array([[.9, .1], [.4, .6]])
P2 = np.array([[.6, .4], [.7, .3]])
Y = np.eye(2)[[0, 1]]


def test_hand_computed_vector_ensemble_nll_and_ece():
  member_probs = np.stack([P1, P2], axis=1)  # (N, M, C)
  combined = np.asarray(combine_logits(np.log(member_probs)), np.float64)
  log_p_bar = combined - np.log(np.exp(combined).sum(-1, keepdims=True))
  assert -(Y * log_p_bar).sum(-1).mean() == pytest.approx(0.543095, abs=1e-6)
  p_bar = member_probs.mean(1)
  np.testing.assert_allclose(p_bar, [[.75, .25], [.55, .45]], atol=1e-12)
  calibration = CalibrationAccumulator(15)
  calibration.update(p_bar, Y)
  assert calibration.result()["ece"] == pytest.approx(0.4, abs=1e-12)


def test_hand_computed_vector_member_and_diversity_metrics():
  stats = EnsembleStats()
  stats.update(np.stack([P1, P2], axis=1), Y, np.ones(2, bool))
  got = stats.metrics("test")
  want = {
      "test/member_0/nll": 0.308093, "test/member_1/nll": 0.857399,
      "test/member_mean/nll": 0.582746,
      "test/member_0/prec@1": 1.0, "test/member_1/prec@1": 0.5, "test/member_mean/prec@1": 0.75,
      "test/diversity/disagreement": 0.5,
      # ensemble error 0.5 (p̄ = [[.75,.25],[.55,.45]], labels [0, 1]): 0.5 / (0.5 + 1e-7)
      "test/diversity/normalized_disagreement": 1.0,
      # M = 2: the one pair i < j, (1, 2): KL(p₁ ‖ p₂), not KL(p₂ ‖ p₁) = 0.247513.
      "test/diversity/kl": 0.209166,
      "test/diversity/cosine_similarity": 0.862914,
  }
  for key, value in want.items():
    assert got[key] == pytest.approx(value, abs=1e-6), key
  # Member ECEs: member 0 conf .9 correct, .6 correct -> (.1 + .4) / 2; member 1 conf .6 correct,
  # .7 wrong (top class 0, label 1) -> (.4 + .7) / 2.
  assert got["test/member_0/ece"] == pytest.approx(0.25, abs=1e-12)
  assert got["test/member_1/ece"] == pytest.approx(0.55, abs=1e-12)
  assert got["test/member_mean/ece"] == pytest.approx(0.4, abs=1e-12)


# --- EnsembleStats against an independent loop-based reference ------------------------------------

def reference_metrics(probs, labels, output, num_bins=15):
  """probs (N, M, C) real rows only; loops over members, points and pairs i < j."""
  n, num_members, num_classes = probs.shape
  out = {}
  per = {"prec@1": [], "nll": [], "ece": []}
  for m in range(num_members):
    correct, nll, confidence = [], [], []
    for x in range(n):
      p, y = probs[x, m], labels[x]
      top = int(np.argmax(p))
      correct.append(y[top] > 0)
      confidence.append(p[top])
      if output == "sigmoid":
        nll.append(-sum(y[c] * np.log(p[c]) + (1 - y[c]) * np.log(1 - p[c])
                        for c in range(num_classes)))
      else:
        nll.append(-sum(y[c] / y.sum() * np.log(p[c]) for c in range(num_classes)))
    correct, confidence = np.array(correct, float), np.array(confidence)
    ece = 0.0
    for b in range(num_bins):
      in_bin = (confidence > b / num_bins) & (confidence <= (b + 1) / num_bins)
      if in_bin.any():
        ece += in_bin.sum() / n * abs(correct[in_bin].mean() - confidence[in_bin].mean())
    for name, value in (("prec@1", correct.mean()), ("nll", np.mean(nll)), ("ece", ece)):
      out[f"member_{m}/{name}"] = value
      per[name].append(value)
  for name, values in per.items():
    out[f"member_mean/{name}"] = np.mean(values)
  if num_members == 1:
    return out
  pairs = [(i, j) for i in range(num_members) for j in range(i + 1, num_members)]
  kl, cosine, disagree = [], [], []
  for i, j in pairs:
    for x in range(n):
      p, q = probs[x, i], probs[x, j]
      if output == "sigmoid":
        kl.append(sum(p[c] * np.log(p[c] / q[c]) + (1 - p[c]) * np.log((1 - p[c]) / (1 - q[c]))
                      for c in range(num_classes)))
      else:
        kl.append(sum(p[c] * np.log(p[c] / q[c]) for c in range(num_classes)))
      cosine.append(np.dot(p, q) / np.sqrt(np.dot(p, p) * np.dot(q, q)))
      disagree.append(float(np.argmax(p) != np.argmax(q)))
  ensemble_correct = [labels[x][np.argmax(probs[x].mean(0))] > 0 for x in range(n)]
  ensemble_error = 1 - np.mean(ensemble_correct)
  out["diversity/kl"] = np.mean(kl)
  out["diversity/cosine_similarity"] = np.mean(cosine)
  out["diversity/disagreement"] = np.mean(disagree)
  out["diversity/normalized_disagreement"] = np.mean(disagree) / (ensemble_error + 1e-7)
  return out


def random_batches(rng, num_members, num_classes, sizes, output, batch_rows=16):
  """Uneven batches of real rows, each padded to `batch_rows` with garbage masked-out rows."""
  batches, real = [], []
  for size in sizes:
    logits = rng.normal(size=(batch_rows, num_members, num_classes)) * rng.uniform(0.5, 3.0)
    if output == "sigmoid":
      probs = sigmoid(logits)
      labels = (rng.uniform(size=(batch_rows, num_classes)) < 0.3).astype(np.float64)
    else:
      probs = softmax(logits)
      labels = np.eye(num_classes)[rng.integers(num_classes, size=batch_rows)]
      labels[0] = 0
      labels[0, :2] = 1  # one multi-hot row: NLL normalises it, prec@1 accepts either class
    mask = np.zeros(batch_rows, bool)
    mask[rng.choice(batch_rows, size, replace=False)] = True
    batches.append((probs, labels, mask))
    real.append((probs[mask], labels[mask]))
  probs = np.concatenate([p for p, _ in real])
  labels = np.concatenate([y for _, y in real])
  return batches, probs, labels


@pytest.mark.parametrize("output", ["softmax", "sigmoid"])
@pytest.mark.parametrize("num_members", [1, 2, 3])
def test_streaming_matches_loop_reference(output, num_members):
  rng = np.random.default_rng(num_members)
  batches, probs, labels = random_batches(rng, num_members, 5, [16, 3, 0, 11, 7], output)
  assert len(probs) == 37
  stats = EnsembleStats(output=output, keep=True)
  for batch in batches:
    stats.update(*batch)
  got = stats.metrics("val")
  want = {f"val/{k}": v for k, v in reference_metrics(probs, labels, output).items()}
  assert set(got) == set(want)
  for key, value in want.items():
    assert got[key] == pytest.approx(value, abs=1e-6), key
  kept = stats.kept()
  assert kept.shape == (num_members, 37, 5) and kept.dtype == np.float32
  np.testing.assert_allclose(kept, probs.transpose(1, 0, 2), atol=1e-7)


def test_single_member_has_no_diversity_keys():
  rng = np.random.default_rng(5)
  batches, _, _ = random_batches(rng, 1, 4, [9], "softmax")
  stats = EnsembleStats()
  stats.update(*batches[0])
  got = stats.metrics("test")
  assert set(got) == {f"test/{who}/{name}" for who in ("member_0", "member_mean")
                      for name in ("prec@1", "nll", "ece")}


def test_kl_with_zero_probabilities_is_finite():
  # A zero in p_i contributes 0; identical members give exactly 0.
  probs = np.array([[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
  stats = EnsembleStats()
  stats.update(probs, np.eye(3)[[0]], np.ones(1, bool))
  got = stats.metrics("t")
  assert got["t/diversity/kl"] == 0.0
  assert got["t/member_0/nll"] == 0.0
  # A zero in p_j under a positive p_i is floored at 1e-12: large but finite.
  stats = EnsembleStats()
  stats.update(np.array([[[.5, .5, 0.0], [1.0, 0.0, 0.0]]]), np.eye(3)[[0]], np.ones(1, bool))
  kl = stats.metrics("t")["t/diversity/kl"]
  assert np.isfinite(kl) and kl == pytest.approx(.5 * np.log(.5 / 1.0) + .5 * np.log(.5 / 1e-12))


def test_rejects_a_change_in_member_count_and_kept_needs_keep():
  stats = EnsembleStats()
  stats.update(np.full((2, 2, 3), 1 / 3), np.eye(3)[[0, 1]], np.ones(2, bool))
  with pytest.raises(ValueError, match="changed"):
    stats.update(np.full((2, 3, 3), 1 / 3), np.eye(3)[[0, 1]], np.ones(2, bool))
  with pytest.raises(ValueError, match="keep=True"):
    stats.kept()
  assert EnsembleStats().metrics("t") == {}
