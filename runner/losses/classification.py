"""Per-example classification losses over (B, C) logits and (B, C) one-/multi-hot labels."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def softmax_xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Cross-entropy against a label distribution (one-hot, smoothed, or normalised multi-hot)."""
  labels = labels / jnp.maximum(labels.sum(-1, keepdims=True), 1e-9)
  return -jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1)


def sigmoid_xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Sum over classes of binary cross-entropy (multi-label, the V-MoE upstream loss on JFT)."""
  return -jnp.sum(labels * jax.nn.log_sigmoid(logits) + (1 - labels) * jax.nn.log_sigmoid(-logits),
                  axis=-1)


LOSSES = {"softmax_xent": softmax_xent, "sigmoid_xent": sigmoid_xent}


def probabilities(logits: np.ndarray, loss_name: str) -> np.ndarray:
  """The model's predictive probabilities under its loss, in float64 on the host: softmax, or
  independent sigmoids for sigmoid models."""
  logits = np.asarray(logits, np.float64)
  if loss_name == "sigmoid_xent":
    return 1.0 / (1.0 + np.exp(-logits))
  shifted = logits - logits.max(axis=-1, keepdims=True)
  e = np.exp(shifted)
  return e / e.sum(axis=-1, keepdims=True)


def precision_at_1(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """1 where the top-scoring class is one of the true labels (multi-label aware, V-MoE B.6)."""
  top = jnp.argmax(logits, axis=-1)
  return (jnp.take_along_axis(labels, top[:, None], axis=-1)[:, 0] > 0).astype(jnp.float32)
