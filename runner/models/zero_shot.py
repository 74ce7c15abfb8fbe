"""A contrastive model as a classifier: zero-shot classification (CLIP, LiT).

`ZeroShotClassifier` holds the class embeddings (each class's normalised mean prompt embedding)
as a parameter, `classes` (C, E), and looks like a catalog classifier to `vmoe eval`'s evaluators.
A sigmoid-loss model's bias, the same for every class, is left out (softmax ignores it)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class ZeroShotClassifier(nn.Module):
  towers: nn.Module  # a TwoTowers
  num_classes: int
  embedding_dim: int

  @nn.compact
  def __call__(self, images, *, train: bool = False, dropout: bool | None = None):
    """(logits (B, C), extras): `pre_logits`, `routing`, `auxiliary_loss` of the image tower,
    `embedding` (the normalised image embedding) and `temperature` t."""
    image_embedding, extras = self.towers(images, None, train=train, dropout=dropout)
    classes = self.param("classes", nn.initializers.zeros_init(),
                         (self.num_classes, self.embedding_dim), jnp.float32)
    similarity = jnp.dot(image_embedding, classes.T, precision=jax.lax.Precision.HIGHEST)
    logits = extras["temperature"] * similarity
    return logits, {"pre_logits": extras["pre_logits"], "routing": extras["routing"],
                    "auxiliary_loss": extras["auxiliary_loss"], "embedding": image_embedding,
                    "temperature": extras["temperature"]}
