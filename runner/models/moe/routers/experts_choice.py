"""Experts-choice routing: each expert picks its top-C tokens of a routing group (Zhou et al. 2022).

As the reference code's `NoisyTopItemsPerExpertRouter` (vmoe/nn/routing.py, vmoe/moe.py
`get_top_items_per_expert_dispatcher`); docs/routers.md states the computation. A token gets 0 to
E experts (none: the residual only); no auxiliary loss, as every expert is full by construction."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from runner.models.moe import routing, z_loss
from runner.models.moe.routers.base import LOSSES, RouterFamily, TorchRouting, register
from runner.models.moe.routers.token_choice import KERNEL_INIT, SHARED_KEYS, CapacityRounding


@dataclasses.dataclass
class ExpertsChoiceConfig:
  """model.router.* of router type experts_choice."""
  capacity_ratio: float = SHARED_KEYS["capacity_ratio"]()
  eval_capacity_ratio: Optional[float] = SHARED_KEYS["eval_capacity_ratio"]()
  noise_std: Optional[float] = SHARED_KEYS["noise_std"]()
  capacity_rounding: CapacityRounding = SHARED_KEYS["capacity_rounding"]()
  z_loss_weight: float = SHARED_KEYS["z_loss_weight"]()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertsChoicePlan:
  """For G groups of S tokens and E experts of C slots (slot s = expert * C + position):
  token_of_slot[g, s] the token in slot s (every slot is filled: C <= S), weight_of_slot[g, s] its
  combine weight, the gate G[token, expert]; gates[g, t, e] the routing gates."""
  token_of_slot: jax.Array
  weight_of_slot: jax.Array
  gates: jax.Array
  num_experts: int = dataclasses.field(metadata=dict(static=True))
  capacity: int = dataclasses.field(metadata=dict(static=True))

  def _rows(self) -> jax.Array:
    """(G * E * C,) indices of the slots' tokens in the flat (G * S) token rows."""
    g, s, _ = self.gates.shape
    return (self.token_of_slot + s * jnp.arange(g, dtype=jnp.int32)[:, None]).reshape(-1)

  def _onehot(self, dtype, weights: bool) -> jax.Array:
    """(G, S, E, C) dispatch (or combine) tensor of the einsum formulation."""
    g, s, e = self.gates.shape
    onehot = jax.nn.one_hot(self.token_of_slot, s, axis=1, dtype=dtype)  # (G, S, E*C)
    if weights:
      onehot = onehot * self.weight_of_slot[:, None, :].astype(dtype)
    return onehot.reshape(g, s, e, self.capacity)

  def dispatch(self, x: jax.Array, method: str = "indices") -> jax.Array:
    """(G, S, D) -> (E, G, C, D); a gather whose gradient is a scatter-add over C*E rows."""
    (g, s, d), e, c = x.shape, self.num_experts, self.capacity
    if method == "einsum":
      return jnp.einsum("gsd,gsec->egcd", x, self._onehot(x.dtype, weights=False))
    buffers = jnp.take(x.reshape(g * s, d), self._rows(), axis=0)
    return buffers.reshape(g, e, c, d).transpose(1, 0, 2, 3)

  def combine(self, y: jax.Array, method: str = "indices") -> jax.Array:
    """(E, G, C, D) -> (G, S, D): each token sums the weighted outputs of the slots it filled."""
    (e, g, c, d), s = y.shape, self.gates.shape[1]
    if method == "einsum":
      return jnp.einsum("egcd,gsec->gsd", y, self._onehot(y.dtype, weights=True))
    weighted = y.transpose(1, 0, 2, 3).reshape(g * e * c, d) * self.weight_of_slot.reshape(
        -1, 1).astype(y.dtype)
    out = jnp.zeros((g * s, d), y.dtype).at[self._rows()].add(weighted)
    return out.reshape(g, s, d)

  def expert_mask(self, routed: bool = True) -> jax.Array:
    """(G, S, E): the experts that picked each token (choice and processing are the same)."""
    del routed
    g, s, e = self.gates.shape
    picked = jax.nn.one_hot(self.token_of_slot.reshape(g, e, self.capacity), s, dtype=jnp.bool_)
    return jnp.any(picked, axis=2).transpose(0, 2, 1)

  def expert_weights(self) -> jax.Array:
    return self.gates


def top_tokens_per_expert(gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
  """(weights, tokens), each (G, E, C): every expert's C largest gates, largest first, ties to the
  lower token index."""
  _, tokens = jax.lax.top_k(jax.lax.stop_gradient(gates).transpose(0, 2, 1), capacity)
  picked = jnp.take_along_axis(gates.transpose(0, 2, 1), tokens, axis=-1)  # gradient flows here
  return picked, tokens.astype(jnp.int32)


def experts_capacity(num_tokens: int, num_experts: int, capacity_ratio: float,
                     rounding: str = "paper") -> int:
  """Tokens each expert picks in a group of `num_tokens`: tokens * C / E rounded as the
  token-choice buffers are (with k = 1), at most the group's tokens."""
  return min(num_tokens, routing.expert_capacity(num_tokens, num_experts, 1, capacity_ratio,
                                                 rounding))


class ExpertsChoiceRouter(nn.Module):
  """Gates softmax(x W + noise); each expert takes its top-C tokens (see the module docstring)."""
  num_experts: int
  capacity_ratio: float = 1.0
  eval_capacity_ratio: float | None = None
  noise_std: float = 1.0
  capacity_rounding: str = "paper"
  z_loss_weight: float = 0.0  # > 0: the logits' z-loss, a metric and a loss (base.LOSSES)

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> tuple[ExpertsChoicePlan, dict]:
    num_groups, num_tokens, _ = x.shape
    e = self.num_experts
    logits = nn.Dense(e, use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32,
                      kernel_init=KERNEL_INIT, name="dense")(x.astype(jnp.float32))
    z = z_loss.z_loss(logits) if self.z_loss_weight else None  # before noise, over the experts
    noise_std = self.noise_std / e
    if train and noise_std > 0:
      logits = logits + noise_std * jax.random.normal(self.make_rng("gating"), logits.shape)
    gates = jax.nn.softmax(logits)
    capacity = experts_capacity(num_tokens, e, routing.ratio_in_force(self, train),
                                self.capacity_rounding)
    weights, tokens = top_tokens_per_expert(gates, capacity)
    plan = ExpertsChoicePlan(token_of_slot=tokens.reshape(num_groups, e * capacity),
                             weight_of_slot=weights.reshape(num_groups, e * capacity),
                             gates=gates, num_experts=e, capacity=capacity)
    per_token = plan.expert_mask().sum(-1)  # (G, S) experts processing each token
    processed = jnp.mean(per_token > 0)
    metrics = {"auxiliary_loss": jnp.zeros((), jnp.float32),
               "experts_per_token_min": jnp.min(per_token).astype(jnp.float32),
               "experts_per_token_mean": jnp.mean(per_token.astype(jnp.float32)),
               "experts_per_token_max": jnp.max(per_token).astype(jnp.float32),
               "fraction_processed_tokens": processed,
               "fraction_dropped_tokens": 1.0 - processed}
    if z is not None:
      metrics["z_loss"] = z
      metrics[LOSSES] = {"z_loss": self.z_loss_weight}  # the model weighs and adds it
    return plan, metrics


@register
class ExpertsChoice(RouterFamily):
  name = "experts_choice"
  module = ExpertsChoiceRouter
  Config = ExpertsChoiceConfig
  summary = "each expert picks its top round(N*C/E) tokens; a token gets 0 to E experts"
  analysis_views = ("experts_per_token",)

  @classmethod
  def module_kwargs(cls, router, *, tokens: int, experts: int) -> dict:
    return dict(capacity_ratio=router.capacity_ratio,
                eval_capacity_ratio=router.eval_capacity_ratio,
                noise_std=1.0 if router.noise_std is None else router.noise_std,
                capacity_rounding=str(router.capacity_rounding),
                **({"z_loss_weight": router.z_loss_weight} if router.z_loss_weight else {}))

  @classmethod
  def capacity(cls, router, tokens: int, experts: int, *, train: bool) -> int:
    return experts_capacity(tokens, experts, routing.ratio_in_force(router, train),
                            router.capacity_rounding)

  @classmethod
  def experts_per_token(cls, router, tokens: int, experts: int, capacity: int) -> float:
    return experts * capacity / tokens

  @classmethod
  def torch_routing(cls, router, *, tokens: int, experts: int) -> TorchRouting:
    """experts_choice_torch.py at the inference capacity ratio (eval_capacity_ratio when set)."""
    del tokens, experts
    return TorchRouting(
        config=dict(capacity_ratio=float(routing.ratio_in_force(router, train=False)),
                    capacity_rounding=str(router.capacity_rounding)),
        source=pathlib.Path(__file__).with_name("experts_choice_torch.py").read_text(),
        class_name="ExpertsChoiceRouter")

  @classmethod
  def dropped_at_capacity(cls, router, weights: jax.Array, capacity: int) -> dict[str, jax.Array]:
    """Each expert's top-`capacity` tokens; the tokens no expert picks are dropped."""
    groups, tokens, _ = weights.shape
    _, picked = top_tokens_per_expert(weights, capacity)  # (G, E, C) token ids
    kept = jnp.zeros((groups, tokens), bool).at[
        jnp.arange(groups)[:, None], picked.reshape(groups, -1)].set(True)
    return {"vanilla": ~kept}
