"""Images as the model takes them: float32, made on the device from the uint8 pixels that cross.

A spec that ends in value_range leaves that op to the jitted step (runner/data/pipeline.py): the
batch holds the uint8 `image` (a quarter of float32's bytes) and each row the op's constants under
`DEVICE_VALUE_RANGE`, applied here in float32 to within one rounding of the host's op. A float
image passes as it is. Every jitted function reads a batch's images through here."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from runner.config.preprocessing import DEVICE_VALUE_RANGE


def images(batch: dict) -> jax.Array:
  """The batch's images as float32 model inputs (B, H, W, C)."""
  image = batch["image"]
  if DEVICE_VALUE_RANGE not in batch:
    return image
  ranges = jnp.asarray(batch[DEVICE_VALUE_RANGE], jnp.float32)
  shape = (ranges.shape[0],) + (1,) * (image.ndim - 1)
  vmin, span, in_min, in_span = (ranges[:, i].reshape(shape) for i in range(4))
  pixels = jnp.asarray(image).astype(jnp.float32)
  # Padding rows (eval batches) carry zeros: their inputs are zeros, as their float images were.
  return jnp.where(in_span == 0, 0.0,
                   vmin + (pixels - in_min) * span / jnp.where(in_span == 0, 1.0, in_span))


def with_images(batch: dict) -> dict:
  """The batch with its float32 images and without the device's value_range."""
  return {**{k: v for k, v in batch.items() if k != DEVICE_VALUE_RANGE}, "image": images(batch)}
