"""Soft MoE: every slot is a weighted mix of the group's tokens (Puigcerver et al. 2023).

As the reference code's `SoftRouter` (vmoe/projects/soft_moe/router.py) and the paper's Algorithm 1;
docs/routers.md states the computation. Nothing is dropped, no auxiliary loss, and the cost depends
on the E * P slots, not the tokens. Metrics: the means over tokens (slots) of the smallest and
largest combine (dispatch) weights, as the reference reports."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from runner.config.checks import at_least, key
from runner.models.moe.routers.base import RouterFamily, TorchRouting, register
from runner.models.moe.routers.token_choice import SHARED_KEYS


@dataclasses.dataclass
class SoftConfig:
  """model.router.* of router type soft."""
  capacity_ratio: float = SHARED_KEYS["capacity_ratio"]()
  slots_per_expert: Optional[int] = key(None, at_least(1), "soft: P, the reference's num_slots; "
                                        "null: round(tokens per group * capacity_ratio / E)")
  noise_std: Optional[float] = SHARED_KEYS["noise_std"]()

EPS = 1e-6


def normalize(x: jax.Array, axis: int = -1) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True) + EPS)


def derived_slots(tokens: int, experts: int, capacity_ratio: float) -> int:
  """round(tokens * C / E) as the reference computes it (`compute_capacity` with 'round' and
  multiple 1: Python's round of the float product, exact halves to even), and at least 1 where
  the reference would raise."""
  return max(1, int(round(tokens * capacity_ratio / experts)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SoftPlan:
  """dispatch_weights and combine_weights: (G, S, E * P), slot n = expert * P + p."""
  dispatch_weights: jax.Array
  combine_weights: jax.Array
  num_experts: int = dataclasses.field(metadata=dict(static=True))
  capacity: int = dataclasses.field(metadata=dict(static=True))

  def dispatch(self, x: jax.Array, method: str = "einsum") -> jax.Array:
    """(G, S, D) -> (E, G, P, D): each slot's convex combination of the group's tokens."""
    del method
    g, _, d = x.shape
    slots = jnp.einsum("gsd,gsn->gnd", x, self.dispatch_weights.astype(x.dtype))
    return slots.reshape(g, self.num_experts, self.capacity, d).transpose(1, 0, 2, 3)

  def combine(self, y: jax.Array, method: str = "einsum") -> jax.Array:
    """(E, G, P, D) -> (G, S, D): each token's convex combination of every slot's output."""
    del method
    e, g, p, d = y.shape
    slots = y.transpose(1, 0, 2, 3).reshape(g, e * p, d)
    return jnp.einsum("gnd,gsn->gsd", slots, self.combine_weights.astype(y.dtype))

  def expert_weights(self) -> jax.Array:
    """(G, S, E): each token's dispatch weight to the slots of each expert, normalised over the
    experts (the share of the token that expert e receives)."""
    g, s, _ = self.dispatch_weights.shape
    per_expert = self.dispatch_weights.reshape(g, s, self.num_experts, self.capacity).sum(-1)
    return per_expert / jnp.sum(per_expert, axis=-1, keepdims=True)

  def expert_mask(self, routed: bool = True) -> None:
    """None: every token reaches every expert, so there is no choice whose change to measure (PGD
    reports no routing change for Soft MoE layers)."""
    del routed
    return None


class SoftRouter(nn.Module):
  """Soft MoE's dispatch and combine weights (see the module docstring)."""
  num_experts: int
  slots_per_expert: int = 1
  noise_std: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> tuple[SoftPlan, dict]:
    num_groups, num_tokens, dim = x.shape
    e, p = self.num_experts, self.slots_per_expert
    mu = self.param("mu", nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                         ("embed", "expert", None)),
                    (dim, e, p), jnp.float32)
    scale = self.param("scale", nn.initializers.ones, (), jnp.float32)
    inputs = normalize(x.astype(jnp.float32), axis=-1)
    mu = normalize(mu, axis=0)
    # The reference multiplies `scale` into the smaller operand; the logits are the same.
    if inputs.size < mu.size:
      inputs = inputs * scale
    else:
      mu = mu * scale
    logits = jnp.einsum("gsd,dn->gsn", inputs, mu.reshape(dim, e * p))
    if train and self.noise_std > 0:
      logits = logits + self.noise_std * jax.random.normal(self.make_rng("gating"), logits.shape)
    dispatch_weights = jax.nn.softmax(logits, axis=1)
    combine_weights = jax.nn.softmax(logits, axis=2)
    plan = SoftPlan(dispatch_weights=dispatch_weights, combine_weights=combine_weights,
                    num_experts=e, capacity=p)
    return plan, {"auxiliary_loss": jnp.zeros((), jnp.float32),
                  "fraction_dropped_tokens": jnp.zeros((), jnp.float32),
                  "combine_weights_min_mean": combine_weights.min(axis=2).mean(),
                  "combine_weights_max_mean": combine_weights.max(axis=2).mean(),
                  "dispatch_weights_min_mean": dispatch_weights.min(axis=1).mean(),
                  "dispatch_weights_max_mean": dispatch_weights.max(axis=1).mean()}


@register
class Soft(RouterFamily):
  name = "soft"
  module = SoftRouter
  Config = SoftConfig
  capacity_at_inference = False  # the slots are parameters (mu)
  discrete = False
  uses_dispatcher = False
  router_parameters = ("mu", "scale")
  analysis_views = ("slot_mixing",)
  summary = ("every slot mixes all tokens of a group, every token mixes all slots; nothing is "
             "dropped (Soft MoE)")

  @classmethod
  def slots(cls, router, tokens: int, experts: int) -> int:
    if router.slots_per_expert is not None:
      return int(router.slots_per_expert)
    return derived_slots(tokens, experts, router.capacity_ratio)

  @classmethod
  def module_kwargs(cls, router, *, tokens: int, experts: int) -> dict:
    return dict(slots_per_expert=cls.slots(router, tokens, experts),
                noise_std=0.0 if router.noise_std is None else router.noise_std)

  @classmethod
  def capacity(cls, router, tokens: int, experts: int, *, train: bool) -> int:
    return cls.slots(router, tokens, experts)

  @classmethod
  def router_flops(cls, tokens: int, dim: int, experts: int, capacity: int) -> float:
    """Logits, dispatch and combine: three (S x D) by (D x E*P)-sized einsums per group."""
    return 3 * 2.0 * tokens * dim * experts * capacity

  @classmethod
  def experts_per_token(cls, router, tokens: int, experts: int, capacity: int) -> float:
    return float(experts)

  @classmethod
  def torch_routing(cls, router, *, tokens: int, experts: int) -> TorchRouting:
    """soft_torch.py with the layer's P slots per expert; `mu` and `scale` keep their layouts."""
    return TorchRouting(
        config=dict(slots_per_expert=cls.slots(router, tokens, experts)),
        source=pathlib.Path(__file__).with_name("soft_torch.py").read_text(),
        class_name="SoftRouter", parameters={"mu": ("mu", None), "scale": ("scale", None)})

  @classmethod
  def sown_records(cls, plan: SoftPlan) -> dict[str, jax.Array]:
    """Which tokens each slot mixes, and which slots each token mixes: (G, S, E * P) each."""
    return {"dispatch_weights": plan.dispatch_weights, "combine_weights": plan.combine_weights}
