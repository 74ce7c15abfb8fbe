"""A sparse MoE MLP block: group tokens, route, dispatch, run experts, combine."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from runner.models.moe import dispatch as dispatch_lib
from runner.models.moe.experts import MlpExperts
from runner.models.moe.router import NoisyTopKRouter


class MoeMlpBlock(nn.Module):
  """Replaces a ViT MLP. Tokens of `group_size` consecutive images form one routing group; all
  tokens of a group compete for the same expert buffers (what Batch Prioritized Routing sorts)."""
  num_experts: int
  mlp_dim: int
  group_size: int = 8
  expert_dropout: float = 0.0
  dispatcher: str = "indices"
  router: dict | None = None  # keyword arguments of NoisyTopKRouter
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> tuple[jax.Array, dict]:
    batch, tokens, dim = x.shape
    group_size = min(self.group_size, batch)
    if batch % group_size:
      raise ValueError(f"batch size {batch} is not a multiple of the routing group size "
                       f"{group_size} images")
    groups = x.reshape(batch // group_size, group_size * tokens, dim)
    plan, metrics = NoisyTopKRouter(num_experts=self.num_experts, **(self.router or {}),
                                    name="router")(groups, train=train)
    buffers = dispatch_lib.dispatch(groups.astype(self.dtype), plan, self.dispatcher)
    outputs = MlpExperts(num_experts=self.num_experts, mlp_dim=self.mlp_dim,
                         dropout_rate=self.expert_dropout, dtype=self.dtype,
                         name="experts")(buffers, train=train)
    y = dispatch_lib.combine(outputs, plan, self.dispatcher)
    return y.reshape(batch, tokens, dim).astype(x.dtype), metrics
