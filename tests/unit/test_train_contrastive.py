"""Contrastive losses against NumPy transcriptions of the HET-XL paper's Eq. 6 and Eq. 8 (with
injected noise draws) and of SigLIP's sigmoid loss; HET-XL's representation noise against its
covariance; retrieval recall against a brute-force ranking."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.evaluators.contrastive import recall_at_k
from runner.losses import contrastive

B, E = 6, 5


def _unit(rng, *shape):
  x = rng.standard_normal(shape)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _log_softmax(x, axis=-1):
  x = x - x.max(axis, keepdims=True)
  return x - np.log(np.exp(x).sum(axis, keepdims=True))


def eq6(a, b, t):
  """(1/2B) Σ_n [−log softmax_j(t a_n·b_j)[n] − log softmax_i(t a_i·b_n)[n]], loops over n."""
  total = 0.0
  for n in range(len(a)):
    total -= _log_softmax(t * np.array([a[n] @ b[j] for j in range(len(b))]))[n]
    total -= _log_softmax(t * np.array([a[i] @ b[n] for i in range(len(a))]))[n]
  return total / (2 * len(a))


def eq8(a, b, a_samples, b_samples, t):
  """Eq. 8 both ways with S samples: text n classified among the images by its noisy samples
  (the mean of their softmax probabilities), image n among the texts by its own."""
  total = 0.0
  for n in range(len(a)):
    p_t2i = np.mean([np.exp(_log_softmax(t * (a @ b_samples[n, s])))[n]
                     for s in range(b_samples.shape[1])])
    p_i2t = np.mean([np.exp(_log_softmax(t * (b @ a_samples[n, s])))[n]
                     for s in range(a_samples.shape[1])])
    total -= np.log(p_t2i) + np.log(p_i2t)
  return total / (2 * len(a))


@pytest.mark.parametrize("t", [1.0, 10.0])
def test_softmax_loss_is_eq_6(t):
  rng = np.random.default_rng(0)
  a, b = _unit(rng, B, E), _unit(rng, B, E)
  loss, metrics = contrastive.softmax_loss(jnp.asarray(a, jnp.float32),
                                           jnp.asarray(b, jnp.float32), t)
  np.testing.assert_allclose(float(loss), eq6(a, b, t), rtol=1e-5)
  sims = a @ b.T
  assert float(metrics["i2t_prec@1"]) == np.mean(sims.argmax(1) == np.arange(B))
  assert float(metrics["t2i_prec@1"]) == np.mean(sims.argmax(0) == np.arange(B))


@pytest.mark.parametrize("samples,chunk", [(1, 8), (3, 8), (5, 2), (4, 1)])
def test_softmax_loss_with_noisy_samples_is_eq_8(samples, chunk):
  rng = np.random.default_rng(samples)
  a, b = _unit(rng, B, E), _unit(rng, B, E)
  a_s = a[:, None] + 0.3 * rng.standard_normal((B, samples, E))  # injected noise draws
  b_s = b[:, None] + 0.3 * rng.standard_normal((B, samples, E))
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  loss, _ = contrastive.softmax_loss(f32(a), f32(b), 3.0, image_samples=f32(a_s),
                                     text_samples=f32(b_s), chunk=chunk)
  np.testing.assert_allclose(float(loss), eq8(a, b, a_s, b_s, 3.0), rtol=1e-5)


def test_one_noise_free_sample_is_the_deterministic_loss():
  rng = np.random.default_rng(7)
  a, b = jnp.asarray(_unit(rng, B, E), jnp.float32), jnp.asarray(_unit(rng, B, E), jnp.float32)
  plain, _ = contrastive.softmax_loss(a, b, 5.0)
  same, _ = contrastive.softmax_loss(a, b, 5.0, image_samples=a[:, None], text_samples=b[:, None])
  np.testing.assert_allclose(float(same), float(plain), rtol=1e-6)


def test_sigmoid_loss_is_siglip():
  rng = np.random.default_rng(1)
  a, b = _unit(rng, B, E), _unit(rng, B, E)
  t, bias = 10.0, -10.0
  want = 0.0
  for i in range(B):
    for j in range(B):
      label = 1.0 if i == j else -1.0
      want -= np.log(1 / (1 + np.exp(-label * (t * a[i] @ b[j] + bias))))
  loss, _ = contrastive.sigmoid_loss(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                                     t, bias)
  np.testing.assert_allclose(float(loss), want / B, rtol=1e-5)


def test_masked_sums_ignore_padded_rows():
  rng = np.random.default_rng(2)
  a, b = _unit(rng, B, E), _unit(rng, B, E)
  real = 4
  mask = np.arange(B) < real
  padded_a = np.concatenate([a[:real], np.zeros((B - real, E))])
  padded_b = np.concatenate([b[:real], np.zeros((B - real, E))])
  sums = contrastive.masked_sums(jnp.asarray(padded_a, jnp.float32),
                                 jnp.asarray(padded_b, jnp.float32), 2.0, jnp.asarray(mask))
  assert float(sums["count"]) == real
  np.testing.assert_allclose(float(sums["loss"]) / real, eq6(a[:real], b[:real], 2.0),
                             rtol=1e-5)
  sims = a[:real] @ b[:real].T
  assert float(sums["i2t_prec@1"]) == np.sum(sims.argmax(1) == np.arange(real))


def test_representation_noise_has_the_het_xl_covariance():
  """ε(z) ~ N(0, V(z)V(z)^T + d(z)d(z)^T): the sample covariance of many draws for one z."""
  from runner.models.contrastive import RepresentationNoise
  module = RepresentationNoise(num_factors=3)
  z = jnp.asarray(np.random.default_rng(3).standard_normal((1, E)), jnp.float32)
  variables = module.init({"params": jax.random.key(0)}, z, 1)
  draws = module.apply(variables, z, 20000, rngs={"het_noise": jax.random.key(1)})[0]
  from flax import linen as nn
  weights = jax.tree.map(np.asarray, nn.meta.unbox(variables["params"]))
  x = np.asarray(z)[0]
  d = np.log1p(np.exp(x @ weights["diag_layer"]["kernel"] + weights["diag_layer"]["bias"])) + 1e-3
  v = (x @ weights["scale_layer"]["kernel"] + weights["scale_layer"]["bias"]).reshape(E, 3)
  sigma = v @ v.T + np.outer(d, d)
  np.testing.assert_allclose(np.cov(np.asarray(draws).T), sigma, atol=0.05 * np.abs(sigma).max())
  np.testing.assert_allclose(np.asarray(draws).mean(0), 0.0, atol=0.05 * np.sqrt(sigma.max()))


def test_recall_at_k_matches_a_brute_force_ranking():
  rng = np.random.default_rng(4)
  n = 50
  a, b = _unit(rng, n, E), _unit(rng, n, E)
  b[:10] = a[:10]  # ten exact partners
  got = recall_at_k(a, b, ks=(1, 5), block=7)
  sims = a @ b.T
  rank_i2t = np.array([np.sum(sims[i] >= sims[i, i]) - 1 for i in range(n)])
  rank_t2i = np.array([np.sum(sims[:, j] >= sims[j, j]) - 1 for j in range(n)])
  assert got["i2t_recall@1"] == np.mean(rank_i2t < 1) >= 0.2
  assert got["i2t_recall@5"] == np.mean(rank_i2t < 5)
  assert got["t2i_recall@5"] == np.mean(rank_t2i < 5)
