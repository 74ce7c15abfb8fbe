"""Heteroscedastic classifier heads (runner/models/heads.py): HET and HET-XL of "Massively Scaling
Heteroscedastic Classifiers" (Collier et al.).

Checked against golden values G1-G6 (the expected probabilities and logits written out below, for
fixed weights and fixed stand-ins for the Gaussian draws, derived by `_numpy_het`, the paper's
equations in NumPy), invariants of the heads
(normalisation, τ bounds, the no-noise limit, HET-XL as HET with its noise sent through the
classifier, the noise covariance, a sigmoid case against Gauss-Hermite quadrature), the parameter
counts of the paper's Table 3, the numerically stable log-mean, the model's plumbing (learned τ
trained by the optimiser, float32 head under bfloat16, noise keys, fine-tuning from a linear
head, FLOPs) and the label-noise data variant.
"""
from __future__ import annotations

import collections
import dataclasses
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats

from runner.config import from_dict, validate
from runner.config.schema import HeadConfig, HeadType, ModelConfig
from runner.errors import ConfigError
from runner.models import build_model, flops, heads
from runner.models.catalog import model_config
from runner.models.heads import HeteroscedasticHead, het_logits
from runner.models.transfer import adapt_params, flatten
from runner.train import optimizers, schedules
from runner.models.size import count_params
from runner.train.state import TrainState, abstract_params
from runner.train.step import make_train_step

# --- golden values: fixed weights and draws, the expected probabilities written out --------------

B, D, K, R, S = 4, 2, 3, 2, 3


def fill(shape, a, phase):
  """a*cos(phase + 0, 1, 2, ...) laid out row-major."""
  n = int(np.prod(shape))
  return (a * np.cos(phase + np.arange(n))).reshape(shape)


X = np.array([[1.0, 2.0], [0.5, 1.5], [0.2, 0.15], [-0.3, 0.0]])
Z = (1.5 * np.sin(1.0 + np.arange(B * S * R))).reshape(B, S, R)  # stands in for N(0, I_R)
ZETA = (1.2 * np.sin(0.5 + np.arange(B * S))).reshape(B, S, 1)  # stands in for N(0, 1)


def golden_weights(q: int, pe: bool, d: int = D, k: int = K, r: int = R) -> dict:
  """The golden values' parameters (cosine fills); q = K (HET) or D (HET-XL)."""
  w = {"loc_layer": (fill((d, k), 1.0, 0.0), fill((k,), 0.5, 1.0)),
       "diag_layer": (fill((d, q), 0.5, 2.0), fill((q,), 0.3, 3.0))}
  if pe:
    w["scale_layer_homoscedastic"] = (fill((r, q), 0.8, 6.0), fill((q,), 0.1, 7.0))
    w["scale_layer_heteroscedastic"] = (fill((d, q), 0.6, 8.0), fill((q,), 0.2, 9.0))
  else:
    w["scale_layer"] = (fill((d, q * r), 0.7, 4.0), fill((q * r,), 0.2, 5.0))
  return {name: {"kernel": jnp.asarray(kb[0], jnp.float32), "bias": jnp.asarray(kb[1], jnp.float32)}
          for name, kb in w.items()}


TAU6 = 0.05 + (5.0 - 0.05) / (1 + np.exp(-0.4))
# name: (output, parameter_efficient, latent (HET-XL), tau, expected probs)
GOLDEN = {
    "G1": ("softmax", False, False, 1.5, [[.22326, .34382, .43291], [.25325, .36654, .38021],
                                          [.40780, .31429, .27791], [.40734, .30686, .28580]]),
    "G2": ("softmax", True, False, 1.5, [[.28288, .27936, .43776], [.34782, .27636, .37582],
                                         [.42240, .30901, .26859], [.40041, .31008, .28952]]),
    "G3": ("softmax", True, True, 1.5, [[.29667, .24201, .46133], [.32110, .26967, .40923],
                                        [.44047, .30541, .25412], [.38161, .31222, .30617]]),
    "G4": ("sigmoid", False, True, 1.5, [[.40498, .34110, .44361], [.43186, .38474, .44899],
                                         [.54528, .45403, .40556], [.50798, .45554, .44411]]),
    "G5": ("sigmoid", True, False, 1.5, [[.45767, .45576, .56857], [.30678, .25752, .32330],
                                         [.61794, .54227, .50641], [.42206, .36152, .34656]]),
    "G6": ("softmax", True, True, TAU6, [[.31325, .28945, .39730], [.32703, .30349, .36948],
                                         [.38567, .32157, .29275], [.35702, .32314, .31984]]),
}


def _numpy_het(name, tau=None) -> tuple[np.ndarray, np.ndarray]:
  """(p̄, logits) of golden case `name`, the paper's equations written out in float64 one example
  and one draw at a time: ε = V(x) z + d(x) ζ with d(x) = softplus(x W_d + b_d) + 10⁻³ and V(x)
  the reshaped x W_V + b_V (HET), or (z J + b_J) ∘ v(x) with v(x) = x W_v + b_v (parameter-
  efficient); HET adds ε to the class logits x W + b, HET-XL sends x + ε through W, b; each draw's
  logits over τ go through σ (softmax or sigmoid), p̄ is their mean over the S draws, and the
  head's logits are log p̄ (softmax) or log p̄ / (1 - p̄) (sigmoid)."""
  output, pe, latent, golden_tau, _ = GOLDEN[name]
  tau = golden_tau if tau is None else float(tau)
  w = {layer: {k: np.asarray(v, np.float64) for k, v in kb.items()}
       for layer, kb in golden_weights(D if latent else K, pe).items()}
  q = D if latent else K
  mean = np.zeros((B, K))
  for b in range(B):
    x = X[b]
    d = np.log1p(np.exp(x @ w["diag_layer"]["kernel"] + w["diag_layer"]["bias"])) + 1e-3
    for s_ in range(S):
      z, zeta = Z[b, s_], ZETA[b, s_, 0]
      if pe:
        j, v = w["scale_layer_homoscedastic"], w["scale_layer_heteroscedastic"]
        low_rank = (z @ j["kernel"] + j["bias"]) * (x @ v["kernel"] + v["bias"])
      else:
        v = (x @ w["scale_layer"]["kernel"] + w["scale_layer"]["bias"]).reshape(q, R)
        low_rank = v @ z
      eps = low_rank + d * zeta
      loc = w["loc_layer"]
      logits = ((x + eps) @ loc["kernel"] + loc["bias"] if latent
                else x @ loc["kernel"] + loc["bias"] + eps) / tau
      if output == "softmax":
        p = np.exp(logits - logits.max())
        mean[b] += p / p.sum() / S
      else:
        mean[b] += 1 / (1 + np.exp(-logits)) / S
  return mean, (np.log(mean) if output == "softmax" else np.log(mean / (1 - mean)))


def test_golden_tables_are_the_papers_equations():
  """The probabilities written out in GOLDEN are _numpy_het's, rounded to 5 decimals."""
  for name, (*_, table) in GOLDEN.items():
    np.testing.assert_allclose(_numpy_het(name)[0], table, atol=5e-6, rtol=0, err_msg=name)


def _golden_logits(name, chunk_size=None, tau=None):
  output, pe, latent, tau6, _ = GOLDEN[name]
  w = golden_weights(D if latent else K, pe)
  return het_logits(jnp.asarray(X, jnp.float32), w, jnp.asarray(Z, jnp.float32),
                    jnp.asarray(ZETA, jnp.float32), tau6 if tau is None else tau, latent=latent,
                    parameter_efficient=pe, output=output, chunk_size=chunk_size)


def _probs(logits, output):
  return np.asarray(jax.nn.softmax(logits) if output == "softmax" else jax.nn.sigmoid(logits))


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("name", list(GOLDEN))
def test_golden_values(name, chunk_size):
  output, *_, expected = GOLDEN[name]
  logits = _golden_logits(name, chunk_size)
  assert logits.shape == (B, K) and logits.dtype == jnp.float32
  np.testing.assert_allclose(_probs(logits, output), expected, atol=1e-5, rtol=0)
  probs, reference_logits = _numpy_het(name)  # unrounded, to float32's precision
  np.testing.assert_allclose(_probs(logits, output), probs, atol=1e-6, rtol=0)
  np.testing.assert_allclose(logits, reference_logits, atol=1e-5, rtol=0)


def test_golden_logits_are_log_p_and_logit_p():
  np.testing.assert_allclose(np.asarray(_golden_logits("G1"))[0], [-1.49940, -1.06763, -0.83722],
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(_golden_logits("G4"))[0], [-0.38476, -0.65839, -0.22651],
                             atol=1e-5)
  # Those rows written out: log p̄ of G1's first example, logit p̄ of G4's (_numpy_het).
  np.testing.assert_allclose(_numpy_het("G1")[1][0], [-1.49940, -1.06763, -0.83722], atol=5e-6)
  np.testing.assert_allclose(_numpy_het("G4")[1][0], [-0.38476, -0.65839, -0.22651], atol=5e-6)
  # The learned temperature of G6: t = 0.4 in the paper's bounds, 0.05 + 4.95 / (1 + e^-0.4).
  tau = heads.temperature(jnp.float32(0.4), 0.05, 5.0)
  assert float(tau) == pytest.approx(3.013504, abs=1e-6)
  assert 0.05 + 4.95 / (1 + np.exp(-0.4)) == pytest.approx(3.013504, abs=5e-7)
  np.testing.assert_allclose(_probs(_golden_logits("G6", tau=tau), "softmax"), GOLDEN["G6"][-1],
                             atol=1e-5)


def test_chunking_changes_neither_the_value_nor_the_gradient():
  """S = 5 in chunks of 2 (padded: 3 chunks, one padded sample) and 5: the same logits and the
  same gradients with respect to every weight and τ as unchunked."""
  rng = np.random.default_rng(3)
  z = jnp.asarray(rng.normal(size=(B, 5, R)), jnp.float32)
  zeta = jnp.asarray(rng.normal(size=(B, 5, 1)), jnp.float32)
  w = golden_weights(D, True)
  labels = jnp.eye(K)[jnp.array([0, 2, 1, 2])]

  def loss(w, tau, chunk):
    logits = het_logits(jnp.asarray(X, jnp.float32), w, z, zeta, tau, latent=True,
                        parameter_efficient=True, chunk_size=chunk)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1)), logits

  results = {c: jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, 1.5, c)
             for c in (None, 2, 5)}
  (ref_loss, ref_logits), ref_grads = results[None]
  for c, ((value, logits), grads) in results.items():
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-6, err_msg=c)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      assert np.all(np.isfinite(np.asarray(a))), c
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=c)


# --- invariants ----------------------------------------------------------------------------------

KINDS = [(latent, pe) for latent in (False, True) for pe in (False, True)]


def _head(latent, pe, output="softmax", **kw):
  return HeteroscedasticHead(5, latent=latent, parameter_efficient=pe, num_factors=3,
                             train_mc_samples=16, eval_mc_samples=24, output=output, **kw)


def _features(n=6, width=8, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(n, width)), jnp.float32)


@pytest.mark.parametrize("latent, pe", KINDS, ids=lambda v: str(v))
def test_probabilities_are_distributions_in_train_and_eval(latent, pe):
  x = _features()
  for output in ("softmax", "sigmoid"):
    head = _head(latent, pe, output)
    variables = head.init({"params": jax.random.key(0)}, x, train=False)
    # Noise of a useful size: a non-zero mean classifier, larger noise scales.
    params = jax.tree.map(lambda p: p * 3.0, variables["params"])
    params["loc_layer"]["kernel"] = jnp.asarray(
        np.random.default_rng(1).normal(size=(8, 5)), jnp.float32)
    for train in (True, False):
      rngs = {heads.NOISE_RNG: jax.random.key(7)} if train else {}
      logits, extras = head.apply({"params": params}, x, train=train, rngs=rngs)
      assert logits.shape == (6, 5) and np.all(np.isfinite(np.asarray(logits)))
      assert extras["loc_logits"].shape == (6, 5)
      if output == "softmax":
        p = np.asarray(jax.nn.softmax(logits))
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
        # logits are log p̄ themselves: already normalised.
        np.testing.assert_allclose(np.exp(np.asarray(logits)).sum(-1), 1.0, atol=1e-5)
      else:
        p = np.asarray(jax.nn.sigmoid(logits))
        assert np.all((p >= 0) & (p <= 1))
        assert 0.0 < p.min() and p.max() < 1.0  # a spread of probabilities, not saturated


def test_temperature_stays_in_its_bounds_and_starts_at_the_midpoint():
  t = jnp.linspace(-30.0, 30.0, 601)
  tau = np.asarray(heads.temperature(t, 0.05, 5.0))
  assert np.all((tau >= 0.05) & (tau <= 5.0))
  inner = np.asarray(heads.temperature(jnp.linspace(-10.0, 10.0, 201), 0.05, 5.0))
  assert np.all((inner > 0.05) & (inner < 5.0)) and np.all(np.diff(inner) > 0)
  assert float(heads.temperature(jnp.float32(0.0), 0.05, 5.0)) == pytest.approx(2.525, abs=1e-6)
  assert float(heads.temperature(jnp.float32(0.0), 0.3, 3.0)) == pytest.approx(1.65, abs=1e-6)
  # The module: a learned τ starts with its parameter at zero, τ at the midpoint.
  head = _head(True, True)
  x = _features()
  variables = head.init({"params": jax.random.key(0)}, x, train=False)
  np.testing.assert_array_equal(np.asarray(variables["params"]["pre_sigmoid_temperature"]), [0.0])
  _, extras = head.apply(variables, x, train=False)
  assert float(extras["temperature"]) == pytest.approx(2.525, abs=1e-6)
  bounded = _head(True, True, temperature_bounds=(1.1, 1.2))
  _, extras = bounded.apply(bounded.init({"params": jax.random.key(0)}, x, train=False), x,
                            train=False)
  assert float(extras["temperature"]) == pytest.approx(1.15, abs=1e-6)
  # A fixed τ has no parameter.
  fixed = _head(True, True, temperature=1.5)
  variables = fixed.init({"params": jax.random.key(0)}, x, train=False)
  assert "pre_sigmoid_temperature" not in variables["params"]
  _, extras = fixed.apply(variables, x, train=False)
  assert float(extras["temperature"]) == 1.5


def test_initialisation_keeps_the_low_rank_part_alive():
  """The mean classifier starts as the linear head (zero kernel, head_bias_init bias); the noise
  layers start lecun-normal, because zero-initialising both parameter-efficient scale layers
  gives both exactly zero gradient (checked below)."""
  head = _head(True, True, head_bias_init=-2.0)
  params = nn.meta.unbox(head.init({"params": jax.random.key(0)}, _features(),
                                   train=False)["params"])
  np.testing.assert_array_equal(np.asarray(params["loc_layer"]["kernel"]), 0.0)
  np.testing.assert_array_equal(np.asarray(params["loc_layer"]["bias"]), -2.0)
  for name in ("diag_layer", "scale_layer_homoscedastic", "scale_layer_heteroscedastic"):
    kernel = np.asarray(params[name]["kernel"])
    assert 0.3 < kernel.std() * np.sqrt(kernel.shape[0]) < 2.0, name  # lecun normal
  # The dead start that initialisation avoids: both PE scale layers zero -> zero gradient to both.
  w = golden_weights(D, True)
  for name in ("scale_layer_homoscedastic", "scale_layer_heteroscedastic"):
    w[name] = jax.tree.map(jnp.zeros_like, w[name])
  grads = jax.grad(lambda w: jax.nn.log_softmax(het_logits(
      jnp.asarray(X, jnp.float32), w, jnp.asarray(Z, jnp.float32), jnp.asarray(ZETA, jnp.float32),
      1.5, latent=True, parameter_efficient=True))[:, 0].sum())(w)
  for name in ("scale_layer_homoscedastic", "scale_layer_heteroscedastic"):
    for leaf in jax.tree.leaves(grads[name]):
      np.testing.assert_array_equal(np.asarray(leaf), 0.0)
  assert np.abs(np.asarray(grads["diag_layer"]["kernel"])).max() > 0


@pytest.mark.parametrize("latent, pe", KINDS, ids=lambda v: str(v))
def test_no_noise_limit_is_the_deterministic_classifier(latent, pe):
  """Zero scale layers, zero diag kernel, diag bias −50 (d ≈ 1e-3): p̄ = σ(μ/τ)."""
  rng = np.random.default_rng(0)
  d, k, r, n, s, tau = 6, 4, 3, 5, 64, 0.7
  q = d if latent else k
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  w = {"loc_layer": {"kernel": jnp.asarray(rng.normal(size=(d, k)), jnp.float32),
                     "bias": jnp.asarray(rng.normal(size=k), jnp.float32)},
       "diag_layer": {"kernel": jnp.zeros((d, q)), "bias": jnp.full((q,), -50.0)}}
  if pe:
    w["scale_layer_homoscedastic"] = {"kernel": jnp.zeros((r, q)), "bias": jnp.zeros(q)}
    w["scale_layer_heteroscedastic"] = {"kernel": jnp.zeros((d, q)), "bias": jnp.zeros(q)}
  else:
    w["scale_layer"] = {"kernel": jnp.zeros((d, q * r)), "bias": jnp.zeros(q * r)}
  z = jnp.asarray(rng.normal(size=(n, s, r)), jnp.float32)
  zeta = jnp.asarray(rng.normal(size=(n, s, 1)), jnp.float32)
  mu = np.asarray(x @ w["loc_layer"]["kernel"] + w["loc_layer"]["bias"])
  for output, sigma in (("softmax", special.softmax), ("sigmoid", special.expit)):
    logits = het_logits(x, w, z, zeta, tau, latent=latent, parameter_efficient=pe, output=output)
    want = sigma(mu / tau, axis=-1) if output == "softmax" else sigma(mu / tau)
    np.testing.assert_allclose(_probs(logits, output), want, atol=5e-3)


@pytest.mark.parametrize("pe", [False, True])
def test_het_xl_is_het_with_logit_noise_through_the_classifier(pe):
  """With the same draws, HET-XL's p̄ equals the mean of σ((μ + ε'W)/τ): HET whose logit noise
  is the pre-logit noise ε' sent through the classifier W."""
  rng = np.random.default_rng(1)
  d, k, r, n, s, tau = 5, 7, 3, 4, 32, 1.3
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  w = golden_weights(d, pe, d=d, k=k, r=r)
  z = jnp.asarray(rng.normal(size=(n, s, r)), jnp.float32)
  zeta = jnp.asarray(rng.normal(size=(n, s, 1)), jnp.float32)
  eps = np.asarray(heads.noise(z, zeta, w, x, parameter_efficient=pe), np.float64)  # (n, s, d)
  kernel = np.asarray(w["loc_layer"]["kernel"], np.float64)
  mu = np.asarray(x, np.float64) @ kernel + np.asarray(w["loc_layer"]["bias"], np.float64)
  u = (mu[:, None, :] + eps @ kernel) / tau
  for output in ("softmax", "sigmoid"):
    logits = het_logits(x, w, z, zeta, tau, latent=True, parameter_efficient=pe, output=output)
    want = (special.softmax(u, axis=-1) if output == "softmax" else special.expit(u)).mean(1)
    np.testing.assert_allclose(_probs(logits, output), want, atol=2e-6)


def _cov(eps):
  centred = eps - eps.mean(1, keepdims=True)
  return np.einsum("bsi,bsj->bij", centred, centred) / (eps.shape[1] - 1)


def _rel(a, b):
  return np.linalg.norm(a - b, axis=(-2, -1)) / np.linalg.norm(b, axis=(-2, -1))


@pytest.mark.parametrize("latent", [True, False], ids=["het_xl", "het"])
def test_noise_covariance(latent):
  """S = 2e5 Gaussian draws: cov(ε') = diag(v) JᵀJ diag(v) + d dᵀ (PE, b_J = 0), V Vᵀ + d dᵀ
  (full), within 1%; the PE noise mean is b_J ∘ v."""
  q = D if latent else K
  s = 200_000
  key_z, key_zeta = jax.random.split(jax.random.key(11))
  z = jax.random.normal(key_z, (B, s, R), jnp.float32)
  zeta = jax.random.normal(key_zeta, (B, s, 1), jnp.float32)
  x = jnp.asarray(X, jnp.float32)
  x64 = np.asarray(X, np.float64)
  w = jax.tree.map(lambda a: np.asarray(a, np.float64), golden_weights(q, True))
  d = np.logaddexp(0.0, x64 @ w["diag_layer"]["kernel"] + w["diag_layer"]["bias"]) + 1e-3
  rank1 = np.einsum("bi,bj->bij", d, d)

  # parameter-efficient, b_J = 0
  pe = golden_weights(q, True)
  pe["scale_layer_homoscedastic"]["bias"] = jnp.zeros(q)
  eps = np.asarray(heads.noise(z, zeta, pe, x, parameter_efficient=True), np.float64)
  v = x64 @ w["scale_layer_heteroscedastic"]["kernel"] + w["scale_layer_heteroscedastic"]["bias"]
  jtj = w["scale_layer_homoscedastic"]["kernel"].T @ w["scale_layer_homoscedastic"]["kernel"]
  want = v[:, :, None] * jtj[None] * v[:, None, :] + rank1
  got = _cov(eps)
  assert np.all(_rel(got, want) < 0.01), _rel(got, want)
  assert np.all(np.abs(eps.mean(1)) < 5 * np.sqrt(np.diagonal(want, axis1=1, axis2=2) / s))
  if latent:  # golden weights, row 0 (values written below), and its logit-space image W^T Σ' W
    np.testing.assert_allclose(want[0], [[1.0584, .6362], [.6362, .7113]], atol=1e-4)
    kernel = w["loc_layer"]["kernel"]
    np.testing.assert_allclose(kernel.T @ want[0] @ kernel,
                               [[.4960, .2760, -.1977], [.2760, .1635, -.0993],
                                [-.1977, -.0993, .0903]], atol=1e-4)
    logit_noise = eps @ kernel
    assert np.all(_rel(_cov(logit_noise)[:1], (kernel.T @ want[0] @ kernel)[None]) < 0.01)

  # parameter-efficient with b_J: the noise has mean b_J ∘ v, the same covariance
  eps_b = np.asarray(heads.noise(z, zeta, golden_weights(q, True), x, parameter_efficient=True),
                     np.float64)
  mean = w["scale_layer_homoscedastic"]["bias"][None] * v
  standard_error = np.sqrt(np.diagonal(want, axis1=1, axis2=2) / s)
  assert np.all(np.abs(eps_b.mean(1) - mean) < 5 * standard_error)
  assert np.abs(mean).max() > 10 * standard_error.max()  # a mean that the check can see
  assert np.all(_rel(_cov(eps_b), want) < 0.01)

  # full: V(x) (Q, R) from the scale layer, row-major
  full = golden_weights(q, False)
  eps = np.asarray(heads.noise(z, zeta, full, x, parameter_efficient=False), np.float64)
  wf = jax.tree.map(lambda a: np.asarray(a, np.float64), full)
  big_v = (x64 @ wf["scale_layer"]["kernel"] + wf["scale_layer"]["bias"]).reshape(B, q, R)
  want = np.einsum("bir,bjr->bij", big_v, big_v) + rank1
  got = _cov(eps)
  assert np.all(_rel(got, want) < 0.01), _rel(got, want)


def test_sigmoid_quadrature_case():
  """A case with a quadrature answer: K = 1, no low-rank part, τ = 0.5: p̄ = E[sigmoid((μ + σ z)/τ)]
  by Gauss-Hermite quadrature; MC with S = 1e5 within 2e-3; τ → 0 gives Φ(μ/σ)."""
  x = jnp.asarray([[-2.0], [-0.5], [0.0], [1.0], [2.5]], jnp.float32)
  w = {"loc_layer": {"kernel": jnp.array([[0.8]]), "bias": jnp.array([0.3])},
       "diag_layer": {"kernel": jnp.array([[0.5]]), "bias": jnp.array([0.2])},
       "scale_layer": {"kernel": jnp.zeros((1, 1)), "bias": jnp.zeros(1)}}  # R = 1, zero: no V
  xs = np.asarray(x, np.float64)[:, 0]
  mu, sigma = 0.8 * xs + 0.3, np.logaddexp(0.0, 0.5 * xs + 0.2) + 1e-3
  np.testing.assert_allclose(mu, [-1.3, -0.1, 0.3, 1.1, 2.3], atol=1e-12)
  np.testing.assert_allclose(sigma, [.3721, .6695, .7991, 1.1042, 1.6617], atol=1e-4)
  nodes, weights = np.polynomial.hermite_e.hermegauss(200)
  weights = weights / weights.sum()

  def truth(tau):
    return (special.expit((mu[:, None] + sigma[:, None] * nodes[None]) / tau) * weights).sum(-1)
  np.testing.assert_allclose(truth(0.5), [.0847, .4629, .6016, .7830, .8887], atol=1e-4)
  s = 100_000
  key_z, key_zeta = jax.random.split(jax.random.key(2))
  z = jax.random.normal(key_z, (5, s, 1), jnp.float32)
  zeta = jax.random.normal(key_zeta, (5, s, 1), jnp.float32)
  draws = np.asarray(zeta, np.float64)[:, :, 0]
  for tau, want, tol in ((0.5, truth(0.5), 2e-3),
                         (0.01, stats.norm.cdf(mu / sigma), 5e-3)):
    logits = het_logits(x, w, z, zeta, tau, latent=False, parameter_efficient=False,
                        output="sigmoid", chunk_size=25_000)
    got = _probs(logits, "sigmoid")[:, 0]
    # Exactly the MC mean of these draws (float64) ...
    mc = special.expit((mu[:, None] + sigma[:, None] * draws) / tau).mean(1)
    np.testing.assert_allclose(got, mc, atol=1e-6)
    # ... which is within MC error of the truth (standard errors here: 2e-4 to 9e-4).
    np.testing.assert_allclose(got, want, atol=tol)
  np.testing.assert_allclose(stats.norm.cdf(mu / sigma), [.0002, .4406, .6463, .8404, .9168],
                             atol=1e-4)


# --- parameter counts (the paper's Table 3) ------------------------------------------------------

def _head_params(num_classes, width, **head):
  """Parameter count of a head on (1, width) features, from shapes only (nothing allocated)."""
  module = (nn.Dense(num_classes) if not head else HeteroscedasticHead(num_classes, **head))
  kwargs = {} if not head else {"train": False}
  shapes = jax.eval_shape(lambda: module.init({"params": jax.random.key(0)},
                                              jnp.zeros((1, width)), **kwargs))
  return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))


def test_parameter_counts_reproduce_the_paper():
  d, k, r = 2048, 21843, 50  # ResNet-152 on ImageNet-21k
  det = _head_params(k, d)
  assert det == d * k + k
  # HET with its grid-searched τ (no parameter); HET-XL with a learned τ (+1), as in Table 3.
  het = _head_params(k, d, num_factors=r, temperature=1.5) - det
  het_xl = _head_params(k, d, latent=True, num_factors=r) - det
  assert het == (d * k + k) + (r * k + k) + (d * k + k) == 90_626_607
  assert het_xl == (d * d + d) + (r * d + d) + (d * d + d) + 1 == 8_497_153
  assert _head_params(k, d, num_factors=r) - det == 90_626_607 + 1  # HET with a learned τ
  # Not parameter-efficient: V(x) has Q·R columns.
  assert _head_params(k, 64, num_factors=3, parameter_efficient=False, temperature=1.0) \
      - _head_params(k, 64) == (64 * k + k) + (64 * k * 3 + k * 3)
  assert _head_params(k, 64, latent=True, num_factors=3, parameter_efficient=False) \
      - _head_params(k, 64) == (64 * 64 + 64) + (64 * 64 * 3 + 64 * 3) + 1


def test_parameter_counts_of_a_vit_l32_on_jft():
  """ViT-L/32 (D = 1024) with K = 18291 classes, through build_model: +38.43M (HET), +2.15M
  (HET-XL) over the linear head; shapes only."""
  base, k = model_config("vit_l32"), 18291

  def total(**head):
    config = dataclasses.replace(base, head=HeadConfig(**head)) if head else base
    shapes, _ = abstract_params(build_model(config, k), (224, 224, 3))
    return count_params(shapes)
  det = total()
  het = total(type=HeadType.het, temperature=0.4) - det
  het_xl = total(type=HeadType.het_xl) - det
  assert het == 38_429_391 and round(het / 1e6, 2) == 38.43
  assert het_xl == 2_151_425 and round(het_xl / 1e6, 2) == 2.15


# --- a learned τ is trained ----------------------------------------------------------------------

IMAGE = (8, 8, 3)
NUM_CLASSES = 3
SMALL = dict(name="heads_test", image_size=8, patch_size=4, hidden_size=16, num_layers=1,
             mlp_dim=32, num_heads=2)


def small(**head) -> ModelConfig:
  return from_dict(ModelConfig, dict(SMALL, head=dict(dict(train_mc_samples=8, eval_mc_samples=8),
                                                       **head)))


def random_params(model, seed=0, scale=0.3):
  shapes, _ = abstract_params(model, IMAGE)
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: jnp.asarray(scale * rng.normal(size=s.shape), s.dtype), shapes)
  if "pre_sigmoid_temperature" in params["head"]:
    params["head"]["pre_sigmoid_temperature"] = jnp.zeros((1,), jnp.float32)
  return params


def _images(n=4, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(n,) + IMAGE), jnp.float32)


def _step(config, weight_decay=0.0):
  model = build_model(config, NUM_CLASSES)
  params = random_params(model)
  schedule = schedules.make_schedule("constant", 0.1, total_steps=10, warmup_steps=0)
  tx = optimizers.make_optimizer("adam", schedule, params, weight_decay=weight_decay)
  state = TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params))
  step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.0,
                                 seed=0))
  batch = {"image": _images(), "labels": jnp.eye(NUM_CLASSES)[jnp.array([0, 1, 2, 0])]}
  return state, step(state, batch)


def test_a_learned_temperature_moves_after_one_step_a_fixed_one_has_no_parameter():
  state, (new, metrics) = _step(small(type="het_xl"), weight_decay=0.1)
  t0 = float(state.params["head"]["pre_sigmoid_temperature"][0])
  t1 = float(new.params["head"]["pre_sigmoid_temperature"][0])
  assert t0 == 0.0 and t1 != 0.0 and abs(t1) == pytest.approx(0.1, rel=1e-2)  # one Adam step
  assert float(metrics["train/temperature"]) == pytest.approx(2.525, abs=1e-6)
  assert np.isfinite(float(metrics["train/loss"]))
  # Weight decay never reaches the temperature (decay would pull τ to the midpoint).
  decay = flatten(optimizers.weight_decay_tree(state.params, 0.1))
  assert decay["head/pre_sigmoid_temperature"] == 0.0
  assert decay["head/loc_layer/kernel"] == decay["head/diag_layer/kernel"] == 0.1
  decay = flatten(optimizers.weight_decay_tree(state.params, [[".*", 0.1]]))
  assert decay["head/pre_sigmoid_temperature"] == 0.0 and decay["head/loc_layer/bias"] == 0.1

  state, (new, metrics) = _step(small(type="het", temperature=1.5))
  assert "pre_sigmoid_temperature" not in state.params["head"]
  assert float(metrics["train/temperature"]) == 1.5
  # Every head parameter trains (the noise layers are not dead).
  for name, before in flatten(state.params["head"]).items():
    assert not np.array_equal(np.asarray(before), np.asarray(flatten(new.params["head"])[name])), \
        name


# --- numerically stable log-mean -----------------------------------------------------------------

def test_the_mc_mean_is_computed_in_log_space():
  """Per-sample logits 100 apart (u ≈ ±300): p̄ of a class underflows float32 in every sample,
  the log-mean does not."""
  # One example, K = 2, S = 2: u = [[0, −300], [0, −200]] (softmax); one class of a sigmoid at
  # u = ±300 and ±200.
  u = np.array([[[0.0, -300.0], [0.0, -200.0]]])
  with np.errstate(divide="ignore"):
    naive = np.log(np.mean(jax.nn.softmax(jnp.asarray(u, jnp.float32)), axis=1))
  assert np.isneginf(naive[0, 1])
  exact = special.logsumexp(u - special.logsumexp(u, axis=-1, keepdims=True), axis=1) - np.log(2)
  got = heads.mc_logits(lambda a: a, (jnp.asarray(u, jnp.float32),), 2, 2, 1)
  assert np.all(np.isfinite(np.asarray(got)))
  np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-6)
  assert float(got[0, 1]) == pytest.approx(-200 - np.log(2), abs=1e-3)

  v = np.array([[[300.0, -300.0], [200.0, -200.0]]])  # sigmoid: p̄ → 1 and → 0
  got = np.asarray(heads.mc_logits(lambda a: a, (jnp.asarray(v, jnp.float32),), 2, 2, 1,
                                   output="sigmoid"))
  p = np.mean(jax.nn.sigmoid(jnp.asarray(v, jnp.float32)), axis=1)
  with np.errstate(divide="ignore"):
    assert np.isinf(np.log(p[0, 0]) - np.log1p(-p[0, 0]))  # the naive logit overflows
  log_p = special.logsumexp(-np.logaddexp(0, -v), axis=1)
  log_q = special.logsumexp(-np.logaddexp(0, v), axis=1)
  np.testing.assert_allclose(got, log_p - log_q, rtol=1e-6)
  assert np.all(np.isfinite(got))


@pytest.mark.parametrize("output", ["softmax", "sigmoid"])
@pytest.mark.parametrize("chunk_size", [None, 1])
def test_het_logits_stay_finite_for_far_apart_samples(output, chunk_size):
  """Through het_logits: a rank-1 noise of scale 100 on class 1 (ζ = ±0.5 around a mean of
  −250) makes its per-sample utilities −300 and −200; the result is the float64 log-mean."""
  x = jnp.zeros((1, 1), jnp.float32)
  w = {"loc_layer": {"kernel": jnp.zeros((1, 2)), "bias": jnp.array([0.0, -250.0])},
       "diag_layer": {"kernel": jnp.zeros((1, 2)),
                      "bias": jnp.array([-50.0, 100.0])},  # d ≈ [1e-3, 100]
       "scale_layer": {"kernel": jnp.zeros((1, 2)), "bias": jnp.zeros(2)}}
  z = jnp.zeros((1, 2, 1), jnp.float32)
  zeta = jnp.array([[[-0.5], [0.5]]], jnp.float32)
  logits = np.asarray(het_logits(x, w, z, zeta, 1.0, latent=False, parameter_efficient=False,
                                 output=output, chunk_size=chunk_size))
  d = np.logaddexp(0.0, np.array([-50.0, 100.0])) + 1e-3
  u = np.array([0.0, -250.0])[None, None] + d[None, None] * np.array([-0.5, 0.5])[None, :, None]
  if output == "softmax":
    want = special.logsumexp(u - special.logsumexp(u, -1, keepdims=True), axis=1) - np.log(2)
  else:
    want = (special.logsumexp(-np.logaddexp(0, -u), axis=1)
            - special.logsumexp(-np.logaddexp(0, u), axis=1))
  assert np.all(np.isfinite(logits))
  np.testing.assert_allclose(logits, want, rtol=1e-5)


# --- bfloat16, keys, reproducibility -------------------------------------------------------------

def _with_loc_kernel(params, seed=1):
  """A non-zero mean classifier, so that the logits depend on the noise."""
  params = jax.tree.map(lambda a: a, params)
  kernel = params["head"]["loc_layer"]["kernel"]
  params["head"]["loc_layer"]["kernel"] = jnp.asarray(
      np.random.default_rng(seed).normal(size=kernel.shape), jnp.float32)
  return params


def test_a_bfloat16_model_keeps_the_head_in_float32():
  config = small(type="het_xl")
  f32 = build_model(config, NUM_CLASSES)
  bf16 = build_model(dataclasses.replace(config, dtype="bfloat16"), NUM_CLASSES)
  shapes, _ = abstract_params(bf16, IMAGE)
  for name, s in flatten(shapes["head"]).items():
    assert s.dtype == jnp.float32, name
  params = random_params(f32, scale=0.2)
  images = _images()
  ref, ref_extras = jax.jit(lambda p: f32.apply({"params": p}, images, train=False))(params)
  out, extras = jax.jit(lambda p: bf16.apply({"params": p}, images, train=False))(params)
  assert out.dtype == jnp.float32
  assert extras["loc_logits"].dtype == jnp.float32 and extras["temperature"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=5e-2)
  np.testing.assert_allclose(np.asarray(jax.nn.softmax(out)), np.asarray(jax.nn.softmax(ref)),
                             atol=2e-2)


@pytest.fixture(scope="module")
def het_xl_model():
  model = build_model(small(type="het_xl", train_mc_samples=6, eval_mc_samples=5), NUM_CLASSES)
  return model, _with_loc_kernel(random_params(model))


def test_eval_is_deterministic_and_uses_the_fixed_key(het_xl_model):
  model, params = het_xl_model
  images = _images()
  apply = jax.jit(lambda p, x: model.apply({"params": p}, x, train=False))
  a, extras = apply(params, images)
  b, _ = apply(params, images)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The documented contract: eval draws come from key(EVAL_NOISE_SEED), split into (z, ζ), with
  # eval_mc_samples samples per example.
  z_key, zeta_key = jax.random.split(jax.random.key(heads.EVAL_NOISE_SEED))
  z = jax.random.normal(z_key, (4, 5, 50), jnp.float32)
  zeta = jax.random.normal(zeta_key, (4, 5, 1), jnp.float32)
  tau = heads.temperature(params["head"]["pre_sigmoid_temperature"][0], 0.05, 5.0)
  want = het_logits(extras["pre_logits"], params["head"], z, zeta, tau, latent=True,
                    parameter_efficient=True)
  np.testing.assert_allclose(np.asarray(a), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_training_draws_from_the_noise_stream(het_xl_model):
  model, params = het_xl_model
  images = _images()

  def apply(key):
    rngs = {"gating": jax.random.key(0), "dropout": jax.random.key(0)}
    if key is not None:
      rngs[heads.NOISE_RNG] = jax.random.key(key)
    return np.asarray(model.apply({"params": params}, images, train=True, rngs=rngs)[0])
  a, b, c = apply(1), apply(1), apply(2)
  np.testing.assert_array_equal(a, b)
  assert np.abs(a - c).max() > 1e-4
  # Training without the stream falls back to the fixed key: still runs, deterministically.
  np.testing.assert_array_equal(apply(None), apply(None))


@pytest.mark.parametrize("latent, pe", KINDS, ids=lambda v: str(v))
def test_share_samples_across_batch(latent, pe):
  x = _features(3)
  x = x.at[2].set(x[0])  # rows 0 and 2 are the same example
  outs = {}
  for share in (True, False):
    head = _head(latent, pe, share_samples_across_batch=share)
    params = head.init({"params": jax.random.key(0)}, x, train=False)["params"]
    params["loc_layer"]["kernel"] = jnp.asarray(np.random.default_rng(1).normal(size=(8, 5)),
                                                jnp.float32)
    for train in (True, False):
      rngs = {heads.NOISE_RNG: jax.random.key(3)} if train else {}
      outs[share, train] = np.asarray(head.apply({"params": params}, x, train=train, rngs=rngs)[0])
  for train in (True, False):
    np.testing.assert_array_equal(outs[True, train][0], outs[True, train][2])
    assert np.abs(outs[False, train][0] - outs[False, train][2]).max() > 1e-4


@pytest.mark.parametrize("latent", [True, False], ids=["het_xl", "het"])
def test_chunked_samples_through_the_module(latent):
  """mc_chunk_size (a scan over chunks inside the flax module): the same logits and gradients
  in a training forward pass."""
  x = _features()
  rngs = {heads.NOISE_RNG: jax.random.key(2)}
  labels = jnp.eye(5)[jnp.array([0, 1, 2, 3, 4, 0])]
  head = _head(latent, True)  # 16 training samples
  params = head.init({"params": jax.random.key(0)}, x, train=False)["params"]
  params["loc_layer"]["kernel"] = jnp.asarray(np.random.default_rng(1).normal(size=(8, 5)),
                                              jnp.float32)

  def run(module):
    def fn(p):
      logits, _ = module.apply({"params": p}, x, train=True, rngs=rngs)
      return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1)), logits
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(params)
  (_, logits), grads = run(head)
  (_, logits_c), grads_c = run(_head(latent, True, mc_chunk_size=6))  # 3 chunks, 2 padded
  np.testing.assert_allclose(np.asarray(logits_c), np.asarray(logits), rtol=1e-5, atol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads_c)[0],
                          jax.tree.leaves(grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


def test_the_noise_stream_is_not_another_stream():
  """make_train_step gives the head's MC draws a key of their own, unlike dropout and gating."""
  seen = []

  class Spy:  # records the rngs a train step passes to the model
    def apply(self, variables, images, train, rngs):
      seen.append({k: tuple(np.asarray(jax.random.key_data(v))) for k, v in rngs.items()})
      logits = images.reshape(images.shape[0], -1)[:, :NUM_CLASSES] * variables["params"]["w"]
      return logits, {"routing": {}, "auxiliary_loss": jnp.zeros(())}
  params = {"w": jnp.ones((NUM_CLASSES,))}
  schedule = schedules.make_schedule("constant", 0.1, total_steps=10, warmup_steps=0)
  tx = optimizers.make_optimizer("sgd", schedule, params, momentum=0.0)
  state = TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params))
  step = make_train_step(Spy(), tx, schedule, loss="softmax_xent", aux_loss_weight=0.0, seed=0)
  step(state, {"image": jnp.ones((2, 4)), "labels": jnp.eye(NUM_CLASSES)[:2]})
  keys = seen[0]
  assert set(keys) == {"gating", "dropout", heads.NOISE_RNG}
  assert len(set(keys.values())) == 3, keys


def test_loc_logits_of_a_partitioned_batch_ensemble_have_one_row_per_image():
  config = from_dict(ModelConfig, dict(
      SMALL, moe=dict(layers=[0], num_experts=4, group_size=2, ensemble_size=2),
      router=dict(k=1), head=dict(type="het_xl", train_mc_samples=4, eval_mc_samples=4)))
  model = build_model(config, NUM_CLASSES)
  images = _images()
  logits, extras = jax.jit(lambda p: model.apply({"params": p}, images, train=False))(
      random_params(model))
  assert logits.shape == (4, NUM_CLASSES) and extras["member_logits"].shape == (4, 2, NUM_CLASSES)
  assert extras["loc_logits"].shape[0] == 4, extras["loc_logits"].shape


# --- fine-tuning from a linear head ---------------------------------------------------------------

def _tree(config, seed, num_classes=NUM_CLASSES):
  shapes, _ = abstract_params(build_model(config, num_classes), IMAGE)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)


@pytest.mark.parametrize("head", [dict(type="het"), dict(type="het_xl"),
                                  dict(type="het", parameter_efficient=False, temperature=1.5)],
                         ids=["het", "het_xl", "het_full_fixed_tau"])
def test_a_linear_head_becomes_the_mean_classifier(head):
  linear = _tree(from_dict(ModelConfig, SMALL), seed=0)
  fresh = _tree(small(**head), seed=1)
  old, new = flatten(linear), flatten(fresh)
  got = flatten(adapt_params(linear, fresh, reinit_head=False))
  assert got.keys() == new.keys()
  np.testing.assert_array_equal(got["head/loc_layer/kernel"], old["head/kernel"])
  np.testing.assert_array_equal(got["head/loc_layer/bias"], old["head/bias"])
  noise = [n for n in new if n.startswith("head/") and not n.startswith("head/loc_layer/")]
  assert noise and ("head/pre_sigmoid_temperature" in noise) == (head.get("temperature") is None)
  for name in noise:  # fresh
    np.testing.assert_array_equal(got[name], new[name], err_msg=name)
  for name in new:  # the body is copied
    if not name.startswith("head/"):
      np.testing.assert_array_equal(got[name], old[name], err_msg=name)
  # reinit_head: the whole head is the fresh one.
  got = flatten(adapt_params(linear, fresh, reinit_head=True))
  for name in new:
    np.testing.assert_array_equal(got[name], new[name] if name.startswith("head/") else old[name],
                                  err_msg=name)
  # And back: a heteroscedastic head's mean classifier becomes a linear head.
  back = flatten(adapt_params(fresh, linear, reinit_head=False))
  np.testing.assert_array_equal(back["head/kernel"], new["head/loc_layer/kernel"])
  np.testing.assert_array_equal(back["head/bias"], new["head/loc_layer/bias"])


def test_a_linear_head_of_other_classes_needs_reinit_head():
  from runner.checkpoints.checkpoint import CheckpointError
  linear = _tree(from_dict(ModelConfig, SMALL), seed=0, num_classes=10)
  fresh = _tree(small(type="het_xl"), seed=1)
  with pytest.raises(CheckpointError, match="init.reinit_head=true"):
    adapt_params(linear, fresh, reinit_head=False)


# --- classes, FLOPs -----------------------------------------------------------------------------

def test_num_classes_of_both_head_kinds():
  assert heads.num_classes(_tree(from_dict(ModelConfig, SMALL), 0, num_classes=7)) == 7
  assert heads.num_classes(_tree(small(type="het"), 0, num_classes=7)) == 7
  assert heads.num_classes(_tree(small(type="het_xl"), 0, num_classes=7)) == 7


@pytest.mark.parametrize("pe", [True, False])
@pytest.mark.parametrize("train", [True, False])
def test_head_flops(pe, train):
  base = model_config("vit_tiny")
  d, k, r = 128, 10, 7
  s = 16 if train else 40
  head = dict(num_factors=r, parameter_efficient=pe, train_mc_samples=16, eval_mc_samples=40)

  def with_head(**h):
    return dataclasses.replace(base, head=HeadConfig(**h))
  det = with_head()
  het, het_xl = with_head(type=HeadType.het, **head), with_head(type=HeadType.het_xl, **head)
  assert flops.head_flops(det, d, k, train=train) == 2 * d * k
  low_rank = (2 * d * k if pe else 2 * d * k * r) + 2 * s * r * k
  assert flops.head_flops(het, d, k, train=train) == 2 * d * k + 2 * d * k + low_rank
  low_rank = (2 * d * d if pe else 2 * d * d * r) + 2 * s * r * d
  assert flops.head_flops(het_xl, d, k, train=train) == \
      2 * d * k + 2 * d * d + low_rank + 2 * s * d * k
  for config in (het, het_xl):
    diff = (flops.forward_flops_per_image(config, k, batch_size=8, train=train)
            - flops.forward_flops_per_image(det, k, batch_size=8, train=train))
    assert diff == flops.head_flops(config, d, k, train=train) - 2 * d * k
  # A pBE runs the head on M rows per image.
  pbe = model_config("vmoe_tiny_m2")
  pbe_het = dataclasses.replace(pbe, head=HeadConfig(type=HeadType.het_xl, **head))
  diff = (flops.forward_flops_per_image(pbe_het, k, batch_size=8, train=train)
          - flops.forward_flops_per_image(pbe, k, batch_size=8, train=train))
  assert diff == 2 * (flops.head_flops(pbe_het, d, k, train=train) - 2 * d * k)


# --- label noise --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits():
  from runner import data
  return data.open_source("uci_digits")


def _noisy(source, split, fraction, **read):
  from runner.data.pipeline import noisy_labels
  ds = source.read(split, with_index=True, **read)
  clean = {int(e["_index"]): int(e["label"]) for e in ds.as_numpy_iterator()}
  noisy = {}
  for e in ds.map(noisy_labels(source, fraction)).as_numpy_iterator():
    assert "_index" not in e
    noisy[len(noisy)] = int(e["label"])
  return clean, [noisy[i] for i in range(len(noisy))]


def test_label_noise_flips_a_fixed_fraction_by_example_index(digits):
  clean, noisy = _noisy(digits, "train", 0.3)
  assert len(clean) == 1258
  labels = np.array([clean[i] for i in sorted(clean)])
  noisy_array = np.array(noisy)
  # 30% are chosen; their random class is the true one 1 time in 10: about 27% change.
  changed = np.mean(noisy_array != labels)
  assert 0.22 <= changed <= 0.32, changed
  # With fraction 1 every example takes its random class: the same classes fraction 0.3 draws
  # for the examples it chooses (the draws depend on the example alone).
  _, everything = _noisy(digits, "train", 1.0)
  random_class = np.array(everything)
  assert np.all((noisy_array == labels) | (noisy_array == random_class))
  differs = random_class != labels  # where a resampled label shows (about 90%)
  assert 0.85 <= differs.mean() <= 0.95
  chosen = np.mean(noisy_array[differs] == random_class[differs])
  assert abs(chosen - 0.3) <= 0.05, chosen
  # Fixed across reads, and a function of the example index alone: a slice and a process's share
  # label their examples as the whole split does.
  assert _noisy(digits, "train", 0.3)[1] == noisy
  assert _noisy(digits, "train[100:]", 0.3)[1] == noisy[100:]
  assert _noisy(digits, "train", 0.3, process_index=1, process_count=2)[1] == noisy[629:]
  assert _noisy(digits, "train", 0.0)[1] == labels.tolist()


def test_train_batches_with_label_noise(digits):
  from runner.data import train_batches

  def epoch(seed, noise):
    """(image bytes, label) pairs of one epoch (1258 = 37 batches of 34)."""
    it = train_batches(digits, "train", "decode(3)|resize(8)|value_range(-1,1)", 34, seed=seed,
                       label_noise=noise)
    pairs = collections.Counter()
    for _ in range(37):
      b = next(it)
      for image, label in zip(b["image"], b["labels"]):
        pairs[(image.tobytes(), int(np.argmax(label)))] += 1
    return pairs
  clean, clean_again = epoch(0, 0.0), epoch(0, 0.0)
  assert clean == clean_again
  noisy0, noisy1 = epoch(0, 0.3), epoch(1, 0.3)
  assert noisy0 == noisy1  # the noisy labels do not depend on the run's seed
  assert noisy0 != clean
  changed = sum((clean - noisy0).values()) / 1258
  assert 0.22 <= changed <= 0.32, changed
  # label_noise=0 is the plain pipeline, batch for batch.
  a = train_batches(digits, "train", "decode(3)|resize(8)|value_range(-1,1)", 34, seed=3)
  b = train_batches(digits, "train", "decode(3)|resize(8)|value_range(-1,1)", 34, seed=3,
                    label_noise=0)
  for _ in range(3):
    x, y = next(a), next(b)
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["labels"], y["labels"])


# --- config checks ------------------------------------------------------------------------------

def _model_problem(**head) -> str:
  config = dataclasses.replace(small(), head=dataclasses.replace(small().head, **head))
  with pytest.raises(ConfigError) as e:
    validate(types.SimpleNamespace(model=config))
  return str(e.value)


@pytest.mark.parametrize("head, expected", [
    (dict(num_factors=0), ["model.head.num_factors=0", ">= 1"]),
    (dict(train_mc_samples=0), ["model.head.train_mc_samples=0", ">= 1"]),
    (dict(eval_mc_samples=-1), ["model.head.eval_mc_samples=-1", ">= 1"]),
    (dict(mc_chunk_size=0), ["model.head.mc_chunk_size=0", ">= 1"]),
    (dict(type=HeadType.het, temperature=9.0), ["model.head.temperature=9.0",
                                                "model.head.temperature_bounds=[0.05, 5.0]"]),
    (dict(type=HeadType.het_xl, temperature=0.01), ["model.head.temperature=0.01"]),
    (dict(type=HeadType.het, temperature=-1.0), ["model.head.temperature=-1.0", "> 0"]),
    (dict(temperature_bounds=[5, 0.05]), ["model.head.temperature_bounds=[5, 0.05]",
                                          "0 < low < high"]),
    (dict(temperature_bounds=[0, 5]), ["model.head.temperature_bounds=[0, 5]"]),
    (dict(temperature_bounds=[1.0]), ["model.head.temperature_bounds=[1.0]"]),
    (dict(type=HeadType.het_xl, latent_dim=7), ["model.head.latent_dim=7", "width 16",
                                                "model.head.latent_dim=16"]),
])
def test_head_config_problems(head, expected):
  message = _model_problem(**head)
  for text in expected:
    assert text in message, (text, message)


def test_valid_head_configs():
  for head in (dict(type=HeadType.het_xl, latent_dim=16), dict(type=HeadType.het, temperature=5.0),
               dict(type=HeadType.det, num_factors=3),  # a linear head ignores the HET keys
               dict(type=HeadType.het, latent_dim=7)):
    config = dataclasses.replace(small(), head=dataclasses.replace(small().head, **head))
    validate(types.SimpleNamespace(model=config))
  with_repr = from_dict(ModelConfig, dict(SMALL, representation_size=24,
                                          head=dict(type="het_xl", latent_dim=24)))
  validate(types.SimpleNamespace(model=with_repr))
  with pytest.raises(ConfigError, match="width 24"):
    validate(types.SimpleNamespace(model=dataclasses.replace(
        with_repr, head=dataclasses.replace(with_repr.head, latent_dim=16))))


def test_an_unknown_head_type():
  with pytest.raises(ConfigError) as e:
    from_dict(ModelConfig, dict(SMALL, head=dict(type="nope")))
  assert "head.type" in str(e.value) and "'nope'" in str(e.value)
  for valid in ("det", "het", "het_xl"):
    assert valid in str(e.value)
