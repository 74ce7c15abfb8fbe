"""The MLPs' nonlinearity, by model.activation's name: one place for the ViT's MLPs, its MAP head's
and the experts of its MoE layers, so that a V-MoE upcycled from a timm or transformers ViT keeps
that ViT's GELU in every expert."""
from __future__ import annotations

import jax
import flax.linen as nn

DEFAULT = "gelu_tanh"  # vmoe's own models: Flax's nn.gelu, the tanh approximation
_FUNCTIONS = {"gelu_tanh": nn.gelu, "gelu": lambda x: nn.gelu(x, approximate=False),
              "quick_gelu": lambda x: x * nn.sigmoid(1.702 * x)}
NAMES = tuple(_FUNCTIONS)


def activate(x: jax.Array, name: str | None = DEFAULT) -> jax.Array:
  """`name`'s nonlinearity of x; None is the default. gelu_tanh calls nn.gelu exactly as vmoe
  always has, so that a model without model.activation compiles to the same program."""
  name = name or DEFAULT
  if name not in _FUNCTIONS:
    raise ValueError(f"unknown activation {name!r}; valid: {', '.join(NAMES)}")
  return _FUNCTIONS[name](x)
