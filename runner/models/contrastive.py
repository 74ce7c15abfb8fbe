"""Two towers for contrastive image-text learning (LiT, Zhai et al. 2022; the HET-XL paper's Sec. 5).

docs/contrastive.md states the model: the towers, the learned scale and bias, HET-XL's noise on
each tower's embedding in training (`noise`; deterministic at evaluation, the paper's App. M) and
LiT's locked image tower (`lock_image`: inference mode, no gradient reaches it)."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from runner.config.schema import ContrastiveLoss, HeadType
from runner.models import build_model, heads
from runner.models.text import TextTransformer

part = nn.with_logical_partitioning
EPS = 1e-8  # added to the norm before dividing by it (LiT)


def normalize(z: jax.Array) -> jax.Array:
  """Unit L2 norm along the last axis: the embeddings whose dot products the losses scale."""
  return z / (jnp.linalg.norm(z, axis=-1, keepdims=True) + EPS)


class RepresentationNoise(nn.Module):
  """HET-XL's noise on a D-dim representation: (B, D) -> (B, S, D) draws of ε(z)."""
  num_factors: int = 15
  parameter_efficient: bool = False

  @nn.compact
  def __call__(self, z: jax.Array, samples: int) -> jax.Array:
    batch, dim = z.shape
    weights = heads.noise_layers(dim, self.num_factors, dim, self.parameter_efficient)
    draws, zeta = heads.noise_draws(self, batch, samples, self.num_factors)
    return heads.noise(draws, zeta, weights, z, parameter_efficient=self.parameter_efficient)


class TwoTowers(nn.Module):
  image: nn.Module  # a VisionTransformer with num_classes=0
  text: nn.Module  # a TextTransformer
  embedding_dim: int = 128
  max_length: int = 16
  temperature_init: float = 10.0
  bias_init: float | None = None  # a learned bias (the sigmoid loss)
  noise: dict | None = None  # HET-XL: num_factors, parameter_efficient, train_mc_samples,
  #                            pre_norm, post_norm
  lock_image: bool = False
  dtype: Any = jnp.float32

  def embed_image(self, images, *, train: bool, dropout: bool | None = None):
    rep, extras = self.image(images, train=train and not self.lock_image,
                             dropout=False if self.lock_image else dropout)
    if self.lock_image:  # LiT: the image tower is a fixed feature extractor
      rep = jax.lax.stop_gradient(rep)
      extras = {**extras, "auxiliary_loss": jnp.zeros(()), "losses": {}}
    z = nn.Dense(self.embedding_dim, name="image_projection",
                 kernel_init=part(nn.initializers.lecun_normal(), (None, "embed")))(rep)
    return z.astype(jnp.float32), extras

  def embed_text(self, tokens, *, train: bool):
    rep = self.text(tokens, train=train)
    z = nn.Dense(self.embedding_dim, name="text_projection",
                 kernel_init=part(nn.initializers.lecun_normal(), (None, "embed")))(rep)
    return z.astype(jnp.float32)

  @nn.compact
  def __call__(self, images, tokens=None, *, train: bool = False, dropout: bool | None = None):
    """(normalised image embeddings (B, E), extras): `pre_logits` (the image tower's
    representation, for few-shot and OOD scores), `routing` and `auxiliary_loss` (its MoE layers),
    `text_embedding` (normalised, with `tokens`), `temperature` t and `bias`; in training with
    HET-XL noise, `image_samples` and `text_samples` (B, S, E). With `images=None` only the text
    tower runs (prompts of zero-shot classification): (None, extras)."""
    if images is None:
      log_scale = self.param("log_temperature", nn.initializers.constant(
          jnp.log(self.temperature_init)), (), jnp.float32)
      return None, {"text_embedding": normalize(self.embed_text(tokens, train=train)),
                    "temperature": jnp.exp(log_scale)}
    zimg, extras = self.embed_image(images, train=train, dropout=dropout)
    extras = {key: extras[key] for key in ("pre_logits", "routing", "auxiliary_loss", "losses")}
    if tokens is None and self.is_initializing():  # the text tower's parameters too
      tokens = jnp.ones((1, self.max_length), jnp.int32)
    log_scale = self.param("log_temperature", nn.initializers.constant(
        jnp.log(self.temperature_init)), (), jnp.float32)
    extras["temperature"] = jnp.exp(log_scale)
    if self.bias_init is not None:
      extras["bias"] = self.param("bias", nn.initializers.constant(self.bias_init), (), jnp.float32)
    ztxt = self.embed_text(tokens, train=train) if tokens is not None else None
    if self.noise is not None:
      noises = {name: RepresentationNoise(self.noise["num_factors"],
                                          self.noise["parameter_efficient"], name=f"{name}_noise")
                for name in ("image", "text")}
      if train and ztxt is not None:
        for name, z in (("image", zimg), ("text", ztxt)):
          extras[f"{name}_samples"] = self._noisy(noises[name], z)
      elif self.is_initializing():  # create the noise layers' parameters
        for name, z in (("image", zimg), ("text", ztxt)):
          noises[name](z, 1)
    extras["text_embedding"] = None if ztxt is None else normalize(ztxt)
    return normalize(zimg), extras

  def _noisy(self, noise: RepresentationNoise, z: jax.Array) -> jax.Array:
    base = normalize(z) if self.noise["pre_norm"] else z
    samples = base[:, None] + noise(z, self.noise["train_mc_samples"])
    return normalize(samples) if self.noise["post_norm"] else samples


def build_two_towers(model_config, text_config, objective, vocab_size: int, *,
                     lock_image: bool = False) -> TwoTowers:
  """The contrastive model: `model_config` the image tower (any catalog model; its head type
  chooses HET-XL noise), `objective` the loss's settings; `lock_image`: LiT."""
  het = model_config.head.type == HeadType.het_xl
  head = model_config.head
  noise = dict(num_factors=head.num_factors, parameter_efficient=head.parameter_efficient,
               train_mc_samples=head.train_mc_samples, pre_norm=objective.noise_pre_norm,
               post_norm=objective.noise_post_norm) if het else None
  sigmoid = objective.loss == ContrastiveLoss.sigmoid
  dtype = jnp.dtype(str(model_config.dtype))
  text = TextTransformer(vocab_size, width=text_config.width, depth=text_config.depth,
                         mlp_dim=text_config.mlp_dim, num_heads=text_config.num_heads,
                         pool=str(text_config.pool), dtype=dtype)
  return TwoTowers(
      image=build_model(model_config, 0), text=text, embedding_dim=objective.embedding_dim,
      max_length=text_config.max_length,
      temperature_init=objective.temperature_init or (3.0 if het else 10.0),
      bias_init=(-10.0 if objective.bias_init is None else objective.bias_init) if sigmoid
      else None, noise=noise, lock_image=lock_image, dtype=dtype)
