"""Heteroscedastic classifier heads: HET and HET-XL (Collier et al., "Massively Scaling
Heteroscedastic Classifiers"), with a temperature learned on the training loss; docs/heads.md
states the model, the loss and the randomness. Samples are processed `mc_chunk_size` at a time
under rematerialisation, so the B x S x K (or B x S x D) tensors never exist whole."""
from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

NOISE_RNG = "het_noise"
EVAL_NOISE_SEED = 0
MIN_SCALE = 1e-3  # added to the softplus of the rank-1 scale (edward2's MIN_SCALE_MONTE_CARLO)

part = nn.with_logical_partitioning


def num_classes(params: dict) -> int:
  """Classes a parameter tree's head predicts (linear, or a heteroscedastic mean classifier); 0
  for a tree without a head (a released backbone, DINOv2's: its representation only)."""
  if (head := params.get("head")) is None:
    return 0
  return int((head["loc_layer"] if "loc_layer" in head else head)["kernel"].shape[-1])


def temperature(pre_sigmoid: jax.Array, low: float, high: float) -> jax.Array:
  """τ = low + (high − low)·sigmoid(t): inside the bounds for every t, their midpoint at t = 0."""
  return low + (high - low) * jax.nn.sigmoid(pre_sigmoid)


def _combine(carry, sample_logits, valid, output: str):
  """Folds a chunk of sample logits (B, c, K) into the running logsumexp over samples."""
  weight = jnp.where(valid, 0.0, -jnp.inf)[None, :, None]  # padded samples count for nothing
  if output == "softmax":
    chunk = jax.nn.logsumexp(jax.nn.log_softmax(sample_logits, axis=-1) + weight, axis=1)
    return (jnp.logaddexp(carry[0], chunk),)
  pos = jax.nn.logsumexp(jax.nn.log_sigmoid(sample_logits) + weight, axis=1)
  neg = jax.nn.logsumexp(jax.nn.log_sigmoid(-sample_logits) + weight, axis=1)
  return (jnp.logaddexp(carry[0], pos), jnp.logaddexp(carry[1], neg))


def mc_logits(sample_logits: Callable, draws: tuple, num_samples: int, num_classes: int,
              batch: int, *, output: str = "softmax", chunk_size: int | None = None) -> jax.Array:
  """(B, K) logits of the mean over `num_samples` of σ(sample_logits(draws of the samples)).

  `draws`: arrays with the sample axis second, (B or 1, S, ...), made for all S samples up front
  (so the result does not depend on c); `sample_logits` maps a chunk to (B, c, K) logits (divided
  by τ). With `chunk_size` c < S, a rematerialised `lax.scan`: memory grows with c, not S."""
  c = min(chunk_size or num_samples, num_samples)
  chunks = math.ceil(num_samples / c)
  if pad := chunks * c - num_samples:
    draws = tuple(jnp.pad(d, [(0, 0), (0, pad)] + [(0, 0)] * (d.ndim - 2)) for d in draws)
  valid = jnp.arange(chunks * c) < num_samples
  empty = jnp.full((batch, num_classes), -jnp.inf, jnp.float32)
  carry = (empty,) if output == "softmax" else (empty, empty)

  def body(carry, i):
    part_draws = tuple(jax.lax.dynamic_slice_in_dim(d, i * c, c, axis=1) for d in draws)
    logits = sample_logits(*part_draws)
    return _combine(carry, logits, jax.lax.dynamic_slice_in_dim(valid, i * c, c), output), None

  if chunks == 1:
    carry, _ = body(carry, 0)
  else:
    carry, _ = jax.lax.scan(jax.checkpoint(body), carry, jnp.arange(chunks))
  log_s = jnp.log(float(num_samples))
  if output == "softmax":
    return carry[0] - log_s
  return (carry[0] - log_s) - (carry[1] - log_s)


def noise(z, zeta, weights: dict, x: jax.Array, *, parameter_efficient: bool) -> jax.Array:
  """ε (B, c, Q) for standard-normal draws z (B|1, c, R) and zeta (B|1, c, 1): the low-rank part
  V(x) z plus the rank-1 part d(x) ζ."""
  d = jax.nn.softplus(x @ weights["diag_layer"]["kernel"] + weights["diag_layer"]["bias"]) + MIN_SCALE
  if parameter_efficient:  # (z J + b_J) ∘ v(x)
    hom, het = weights["scale_layer_homoscedastic"], weights["scale_layer_heteroscedastic"]
    v = x @ het["kernel"] + het["bias"]
    low_rank = (z @ hom["kernel"] + hom["bias"]) * v[:, None, :]
  else:  # V(x) z, V(x) = reshape(x W_s + b_s, (Q, R))
    scale = weights["scale_layer"]
    v = (x @ scale["kernel"] + scale["bias"]).reshape(x.shape[0], d.shape[-1], -1)
    low_rank = jnp.einsum("bqr,bsr->bsq", v, jnp.broadcast_to(z, (x.shape[0],) + z.shape[1:]))
  return low_rank + d[:, None, :] * zeta


def het_logits(x, weights: dict, z, zeta, tau, *, latent: bool, parameter_efficient: bool,
               output: str = "softmax", chunk_size: int | None = None) -> jax.Array:
  """The head's logits for given draws: a pure function (the golden-value tests inject draws)."""
  loc = weights["loc_layer"]
  batch, num_samples, num_classes = x.shape[0], z.shape[1], loc["kernel"].shape[-1]

  def sample_logits(z_c, zeta_c):
    eps = noise(z_c, zeta_c, weights, x, parameter_efficient=parameter_efficient)
    if latent:  # HET-XL: the noisy representation through the shared classifier
      lat = (x[:, None, :] + eps) @ loc["kernel"] + loc["bias"]
    else:
      lat = (x @ loc["kernel"] + loc["bias"])[:, None, :] + eps
    return lat / tau

  return mc_logits(sample_logits, (z, zeta), num_samples, num_classes, batch, output=output,
                   chunk_size=chunk_size)


class _Linear(nn.Module):
  """The kernel and bias of a dense layer (the parameters of `nn.Dense`, used as plain arrays)."""
  features: int
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros
  axes: tuple = (None, None)

  @nn.compact
  def __call__(self, in_features: int) -> dict:
    kernel = self.param("kernel", part(self.kernel_init, self.axes), (in_features, self.features),
                        jnp.float32)
    bias = self.param("bias", part(self.bias_init, self.axes[-1:]), (self.features,), jnp.float32)
    return {"kernel": kernel, "bias": bias}


def noise_layers(q: int, r: int, width: int, parameter_efficient: bool) -> dict:
  """`noise`'s weights for inputs of `width`, made in the calling module's compact method:
  diag_layer, and the scale layers of v(x) (parameter-efficient) or of V(x)."""
  scales = ({"scale_layer_homoscedastic": (q, r), "scale_layer_heteroscedastic": (q, width)}
            if parameter_efficient else {"scale_layer": (q * r, width)})
  return {name: _Linear(features, name=name)(inputs)
          for name, (features, inputs) in {"diag_layer": (q, width), **scales}.items()}


def noise_draws(module: nn.Module, rows: int, samples: int, r: int) -> tuple[jax.Array, jax.Array]:
  """`noise`'s z (rows, samples, R) and zeta (rows, samples, 1), drawn from the module's NOISE_RNG,
  or from EVAL_NOISE_SEED where it has none (evaluation; initialisation: shapes only)."""
  key = module.make_rng(NOISE_RNG) if module.has_rng(NOISE_RNG) else jax.random.key(EVAL_NOISE_SEED)
  z_key, zeta_key = jax.random.split(key)
  return (jax.random.normal(z_key, (rows, samples, r), jnp.float32),
          jax.random.normal(zeta_key, (rows, samples, 1), jnp.float32))


class HeteroscedasticHead(nn.Module):
  """HET (`latent=False`) or HET-XL (`latent=True`). Argument names are `model.head.*` keys.

  `loc_layer` is the mean classifier (zero-initialised with `head_bias_init` as the deterministic
  head, whose parameters it takes over when fine-tuning); the noise layers keep lecun-normal initialisations so that the
  low-rank part trains (zeros in both parameter-efficient scale layers would freeze it)."""
  num_classes: int
  latent: bool = False
  num_factors: int = 50
  parameter_efficient: bool = True
  train_mc_samples: int = 1000
  eval_mc_samples: int = 1000
  temperature: float | None = None  # None: learned within temperature_bounds
  temperature_bounds: tuple = (0.05, 5.0)
  mc_chunk_size: int | None = None
  share_samples_across_batch: bool = False
  head_bias_init: float = 0.0
  output: str = "softmax"

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> tuple[jax.Array, dict]:
    x = x.astype(jnp.float32)  # the head stays float32 under bfloat16 compute
    batch, width = x.shape
    q = width if self.latent else self.num_classes
    r = self.num_factors
    weights = {"loc_layer": _Linear(
        self.num_classes, nn.initializers.zeros, nn.initializers.constant(self.head_bias_init),
        axes=(None, "classes"), name="loc_layer")(width),
        **noise_layers(q, r, width, self.parameter_efficient)}
    if self.temperature is None:
      t = self.param("pre_sigmoid_temperature", nn.initializers.zeros, (1,), jnp.float32)
      tau = temperature(t[0], *self.temperature_bounds)
    else:
      tau = jnp.asarray(self.temperature, jnp.float32)
    samples = self.train_mc_samples if train else self.eval_mc_samples
    rows = 1 if self.share_samples_across_batch else batch
    z, zeta = noise_draws(self, rows, samples, r)
    logits = het_logits(x, weights, z, zeta, tau, latent=self.latent,
                        parameter_efficient=self.parameter_efficient, output=self.output,
                        chunk_size=self.mc_chunk_size)
    loc = x @ weights["loc_layer"]["kernel"] + weights["loc_layer"]["bias"]
    return logits, {"loc_logits": loc, "temperature": tau}
