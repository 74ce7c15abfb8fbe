"""Importance and load losses against eqs. (1)-(6) of the V-MoE paper (Appendix A.2)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.models.moe import routing
from moe_reference import (importance_loss_reference, load_loss_reference, plan_dispatch_jit,
                           squared_cv_reference)


def test_squared_cv_matches_population_definition():
  values = np.array([[1.0, 2.0, 3.0, 6.0], [5.0, 5.0, 5.0, 5.0], [0.1, 0.0, 0.0, 0.3]])
  got = np.asarray(routing.squared_cv(jnp.asarray(values, jnp.float32)))
  want = [squared_cv_reference(v) for v in values]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got[1] == 0.0


def test_squared_cv_gradient_is_finite_at_perfect_balance():
  grad = jax.grad(lambda v: routing.squared_cv(v))(jnp.full((4,), 0.25))
  assert np.isfinite(np.asarray(grad)).all()
  np.testing.assert_allclose(np.asarray(grad), 0.0, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_importance_loss_matches_eqs_1_2(seed):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(3, 10, 5)) * 1.5 + rng.normal(size=5)
  gates = jax.nn.softmax(jnp.asarray(logits, jnp.float32))
  got = np.asarray(routing.importance_loss(gates))
  assert got.shape == (3,)
  np.testing.assert_allclose(got, importance_loss_reference(logits), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("seed,k,sigma", [(0, 1, 0.2), (1, 2, 0.2), (2, 1, 1.0), (3, 3, 0.5)])
def test_load_loss_matches_eqs_3_6(seed, k, sigma):
  rng = np.random.default_rng(seed)
  e = 5
  clean = rng.normal(size=(3, 12, e)) * 0.5 + rng.normal(size=e) * 0.3
  noisy = clean + sigma * rng.normal(size=clean.shape)
  got = np.asarray(routing.load_loss(jnp.asarray(clean, jnp.float32),
                                     jnp.asarray(noisy, jnp.float32), sigma, k))
  assert got.shape == (3,)
  want = load_loss_reference(clean, noisy, sigma, k)
  assert (want > 1e-4).all()  # non-trivial loads, so a relative tolerance is meaningful
  np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6)


def test_load_loss_uses_kth_noisy_score_as_threshold():
  """One token, E=3: the threshold of eq. (3) comes from the NOISY scores (k-th largest) while
  eq. (4) shifts it by the CLEAN score of each expert."""
  clean = np.array([[[0.0, 0.0, 0.0]]])
  noisy = np.array([[[0.3, -0.2, 0.1]]])
  sigma = 0.5
  for k, threshold in [(1, 0.3), (2, 0.1), (3, -0.2)]:
    # p_i = P(eps >= threshold - 0) is the same for every expert: perfectly balanced load ...
    got = float(routing.load_loss(jnp.asarray(clean), jnp.asarray(noisy), sigma, k)[0])
    assert abs(got) < 1e-10
  # ... and with distinct clean scores the value pins down threshold and sign convention.
  clean = np.array([[[0.2, -0.1, 0.0]]])
  for k in (1, 2, 3):
    got = float(routing.load_loss(jnp.asarray(clean, jnp.float32),
                                  jnp.asarray(noisy, jnp.float32), sigma, k)[0])
    np.testing.assert_allclose(got, load_loss_reference(clean, noisy, sigma, k)[0], rtol=1e-4)


# Table 3 of the paper (k = 1): tokens alternate between (0.9, 0.5, 0.1) and (0.1, 0.5, 0.9).
TABLE3_WEIGHTS = np.array([[0.9, 0.5, 0.1], [0.1, 0.5, 0.9]] * 4)  # 8 tokens


def test_table3_importance_is_blind_to_unbalanced_assignments():
  """The average weights are balanced, so the importance loss is ~0, although Expert 2 is never
  selected: assignment counts are (4, 0, 4), a squared CV of 0.5."""
  # Rows are the paper's w; importance only sums them, so rescaling rows to a softmax (all rows
  # sum to 1.5) does not change the (zero) loss. logits = log(w) gives softmax(logits) = w / 1.5.
  logits = np.log(TABLE3_WEIGHTS)[None]
  gates = jax.nn.softmax(jnp.asarray(logits, jnp.float32))
  np.testing.assert_allclose(np.asarray(gates[0]), TABLE3_WEIGHTS / 1.5, rtol=1e-5)
  importance = float(routing.importance_loss(gates)[0])
  assert importance < 1e-10
  plan = plan_dispatch_jit(gates, k=1, capacity=8, batch_priority=False, priority="max")
  counts = np.asarray(plan.expert_of_slot_filled[0])
  np.testing.assert_array_equal(counts, [4, 0, 4])
  assert squared_cv_reference(counts) == pytest.approx(0.5)


@pytest.mark.parametrize("sigma", [1 / 3, 0.05])
def test_table3_load_loss_sees_the_imbalance(sigma):
  """The load loss is a smooth proxy of the assignment counts; it is clearly non-zero on Table 3,
  and as the noise sigma -> 0 each selected expert gets p = 1/2 and the others p -> 0, so the loss
  tends to the squared CV of the counts (0.5). With sigma = 1/E it is smaller but far from 0."""
  logits = np.log(TABLE3_WEIGHTS)[None]
  # Evaluate at eps = 0 (noisy == clean) for a deterministic example.
  got = float(routing.load_loss(jnp.asarray(logits, jnp.float32),
                                jnp.asarray(logits, jnp.float32), sigma, 1)[0])
  np.testing.assert_allclose(got, load_loss_reference(logits, logits, sigma, 1)[0], rtol=1e-4)
  if sigma < 0.1:
    assert got == pytest.approx(0.5, abs=1e-3)
  else:
    assert 0.2 < got < 0.5
  importance = float(routing.importance_loss(jax.nn.softmax(jnp.asarray(logits)))[0])
  assert got > importance + 0.2
