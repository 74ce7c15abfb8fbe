"""A contrastive model as a classifier: zero-shot classification (CLIP, LiT).

`ZeroShotClassifier` wraps the two towers (runner/models/contrastive.py) and holds the class
embeddings as a parameter, `classes` (C, E): the normalised mean of each class's prompt embeddings
(runner/evaluators/contrastive.py `class_embeddings`), computed once from the text tower before
evaluation. An image's logits are t · (its normalised embedding · each class embedding), t the
model's learned scale, so softmax(logits) is the model's zero-shot predictive distribution. (A
sigmoid-loss model's bias shifts every class alike and is left out: the softmax ignores it.)

It looks like a catalog classifier, `(images, train) -> (logits (B, C), extras)` with the image
tower's `pre_logits` and `routing` in `extras`, so every evaluator of `vmoe eval` (classification,
calibration, OOD detection including Mahalanobis on the pre-logits, corruptions, PGD, routing
analysis, compute, capacity sweeps) runs on it unchanged. Its parameters are `{"towers": the
contrastive checkpoint's parameters, "classes": (C, E)}`; only the image tower runs per image.
"""
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
