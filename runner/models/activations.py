"""The MLPs' nonlinearity, by model.activation's name: one place for the ViT's MLPs, its MAP head's
and the experts of its MoE layers, so that a V-MoE upcycled from a timm or transformers ViT keeps
that ViT's GELU in every expert."""
from __future__ import annotations

import jax
import flax.linen as nn

DEFAULT = "gelu_tanh"  # vmoe's own models: Flax's nn.gelu, the tanh approximation
NAMES = ("gelu_tanh", "gelu", "quick_gelu")


def activate(x: jax.Array, name: str | None = DEFAULT) -> jax.Array:
  """`name`'s nonlinearity of x; None is the default. gelu_tanh calls nn.gelu exactly as vmoe
  always has, so that a model without model.activation compiles to the same program."""
  name = name or DEFAULT
  if name == "gelu_tanh":
    return nn.gelu(x)
  if name == "gelu":
    return nn.gelu(x, approximate=False)
  if name == "quick_gelu":
    return x * nn.sigmoid(1.702 * x)
  raise ValueError(f"unknown activation {name!r}; valid: {', '.join(NAMES)}")
