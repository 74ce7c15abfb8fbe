"""The text tower of a contrastive model: a Transformer encoder over tokens, as LiT's and CLIP's
(docs/contrastive.md), with runner/models/vit.py's pre-LN blocks, padding (token id 0) masked out
of attention, and one vector per caption (`pool`)."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from runner.models.vit import EncoderBlock

part = nn.with_logical_partitioning
POOLS = ("last", "mean", "first")

# name: (width, depth, mlp_dim, num_heads) — the ViT sizes of big_vision's text towers, and a CPU size.
TEXT_SIZES = {
    "text_tiny": (128, 2, 512, 4),
    "text_ti": (192, 12, 768, 3),
    "text_s": (384, 12, 1536, 6),
    "text_b": (768, 12, 3072, 12),
    "text_l": (1024, 24, 4096, 16),
}


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
