"""The text tower of a contrastive model: a Transformer encoder over tokens, as LiT's and CLIP's
(docs/contrastive.md), with runner/models/vit.py's pre-LN blocks, padding (token id 0) masked out
of attention, and one vector per caption (`pool`)."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from runner.models.catalog import SOFT_SIZES
from runner.models.vit import EncoderBlock

part = nn.with_logical_partitioning
POOLS = ("last", "mean", "first")

# name: (width, depth, mlp_dim, num_heads) — a CPU size, and the ViT sizes of big_vision's text
# towers (the Soft MoE paper's, runner/models/catalog.py).
TEXT_SIZES = {"text_tiny": (128, 2, 512, 4),
              **{f"text_{size}": SOFT_SIZES[size] for size in ("ti", "s", "b", "l")}}


class TextTransformer(nn.Module):
  vocab_size: int
  width: int = 128
  depth: int = 2
  mlp_dim: int = 512
  num_heads: int = 4
  pool: str = "last"
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens: jax.Array, *, train: bool) -> jax.Array:
    """tokens (B, L) int32 -> (B, width) float32."""
    b, length = tokens.shape
    mask = tokens > 0
    x = nn.Embed(self.vocab_size, self.width, dtype=self.dtype, name="token_embedding",
                 embedding_init=part(nn.initializers.normal(0.02), (None, "embed")))(tokens)
    pos = self.param("pos_embedding", part(nn.initializers.normal(0.02), (None, None, "embed")),
                     (1, length, self.width))
    x = x + pos.astype(x.dtype)
    for i in range(self.depth):
      x, _ = EncoderBlock(self.mlp_dim, self.num_heads, dtype=self.dtype, name=f"block_{i}")(
          x, train=train, mask=mask)
    x = nn.LayerNorm(dtype=self.dtype, name="encoder_norm")(x)
    if self.pool == "last":  # the end-of-text token: the last one that is not padding
      last = jnp.maximum(mask.sum(-1) - 1, 0)
      x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    elif self.pool == "mean":
      weights = mask.astype(x.dtype)[..., None]
      x = (x * weights).sum(1) / jnp.maximum(weights.sum(1), 1)
    elif self.pool == "first":
      x = x[:, 0]
    else:
      raise ValueError(f"unknown text pooling {self.pool!r}; valid: {POOLS}")
    return x.astype(jnp.float32)
