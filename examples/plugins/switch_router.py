"""A Switch-style top-1 router with ST-MoE's router z-loss, as a vmoe plug-in.

Run it from the folder that holds this file:

  vmoe pretrain plugins=[switch_router] model.router.type=switch model.router.z_loss_weight=0.001

Routing (Fedus et al. 2021, "Switch Transformers", Sec. 2.1-2.2): each token goes to the one
expert with the largest softmax(Wx) probability, scaled by that probability; each expert has
round(tokens * C / E) slots per routing group and drops the tokens past them, in token order.
The auxiliary loss is Switch's load-balancing loss E * sum_i f_i * P_i (f_i: the share of tokens
whose choice is expert i, P_i: the mean router probability of expert i; 1 when balanced), which
vmoe multiplies by train.aux_loss_weight (0.01: Switch's alpha). With `z_loss_weight` > 0 the
router also reports ST-MoE's router z-loss of its logits as `z_loss` (Zoph et al. 2022, Eq. 5:
runner/models/moe/z_loss.py) and hands it over as a loss with its weight (`LOSSES`): the model
adds z_loss_weight times its sum over the layers to the training loss, logged as train/z_loss, as
for the built-in routers (ST-MoE's weight: 0.001).

A router family is three things (docs/extending.md): its keys (a dataclass), a Flax module that
returns a dispatch plan and its metrics, and a `RouterFamily` that answers the rest of vmoe;
here also its router in PyTorch (`torch_routing`), so that `vmoe export` can write its models.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from runner.config.checks import at_least, key, positive
from runner.models.moe import routing, z_loss
from runner.models.moe.routers import LOSSES, RouterFamily, TorchRouting, register


@dataclasses.dataclass
class SwitchConfig:
  """model.router.* of router type switch. Every key here is one the built-in families declare
  too: a shared key keeps the same type and default everywhere."""
  capacity_ratio: float = key(1.05, positive(), "1.05 upstream; below 1 drops tokens, which "
                              "Batch Prioritized Routing makes graceful")
  eval_capacity_ratio: Optional[float] = key(None, positive(), "null: same as capacity_ratio")
  z_loss_weight: float = key(0.0, at_least(0), "c_z of ST-MoE's router z-loss, added to the "
                             "training loss: the paper's 0.001; 0: off")


class SwitchRouter(nn.Module):
  """x: (G, S, D) routing groups -> (plan, metrics); the plan is vmoe's token-choice plan with
  k = 1, so dispatching, combining and introspection work unchanged."""
  num_experts: int
  capacity_ratio: float = 1.05
  eval_capacity_ratio: Optional[float] = None
  z_loss_weight: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool):
    _, num_tokens, _ = x.shape
    logits = nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32,
                      param_dtype=jnp.float32, name="dense")(x.astype(jnp.float32))
    gates = jax.nn.softmax(logits)
    ratio = self.capacity_ratio
    if not train and self.eval_capacity_ratio is not None:
      ratio = self.eval_capacity_ratio
    capacity = routing.expert_capacity(num_tokens, self.num_experts, 1, ratio)
    plan = routing.plan_dispatch(gates, k=1, capacity=capacity)
    chosen = jax.nn.one_hot(plan.experts[..., 0], self.num_experts)  # (G, S, E)
    balance = self.num_experts * jnp.sum(chosen.mean(axis=1) * gates.mean(axis=1), axis=-1)
    kept = plan.kept
    metrics = {
        "load_balancing_loss": balance.mean(),
        "auxiliary_loss": balance.mean(),
        "fraction_dropped_tokens": jnp.mean(~kept.any(axis=-1)),
        "expert_load": jnp.mean(plan.expert_of_slot_filled, axis=0) / capacity,
    }
    if self.z_loss_weight:  # a metric, and a loss the router hands over with its weight
      metrics["z_loss"] = z_loss.z_loss(logits)
      metrics[LOSSES] = {"z_loss": self.z_loss_weight}
    return plan, metrics


# The router at inference in PyTorch, which `vmoe export` appends to the exported modeling_vmoe.py:
# it uses that file's names (torch, nn, F, expert_capacity, plan_top_k) and imports nothing.
TORCH_SOURCE = '''
class SwitchRouter(nn.Module):
  """Top-1 of softmax(x W) in float32; round(N * C / E) slots per expert, in token order."""

  def __init__(self, config: dict, dim: int, num_experts: int):
    super().__init__()
    self.config = config
    self.dense = nn.Linear(dim, num_experts, bias=False)

  def forward(self, x, first: int, count: int):
    gates = torch.softmax(F.linear(x.float(), self.dense.weight[first:first + count]), dim=-1)
    capacity = expert_capacity(x.shape[1], count, 1, self.config["capacity_ratio"])
    return plan_top_k(gates, 1, capacity)
'''


@register
class Switch(RouterFamily):
  name = "switch"
  module = SwitchRouter
  Config = SwitchConfig
  summary = "each token goes to its top-1 expert, buffers of round(N*C/E) slots (Switch)"

  @classmethod
  def module_kwargs(cls, router, *, tokens: int, experts: int) -> dict:
    return dict(capacity_ratio=router.capacity_ratio,
                eval_capacity_ratio=router.eval_capacity_ratio,
                z_loss_weight=router.z_loss_weight)

  @classmethod
  def capacity(cls, router, tokens: int, experts: int, *, train: bool) -> int:
    ratio = router.capacity_ratio
    if not train and router.eval_capacity_ratio is not None:
      ratio = router.eval_capacity_ratio
    return routing.expert_capacity(tokens, experts, 1, ratio)

  @classmethod
  def experts_per_token(cls, router, tokens: int, experts: int, capacity: int) -> float:
    return 1.0

  @classmethod
  def torch_routing(cls, router, *, tokens: int, experts: int) -> TorchRouting:
    """The PyTorch router above at the inference capacity ratio; its `dense/kernel` becomes the
    `nn.Linear` named `dense` (TorchRouting's default mapping)."""
    ratio = router.capacity_ratio
    if router.eval_capacity_ratio is not None:
      ratio = router.eval_capacity_ratio
    return TorchRouting(config={"capacity_ratio": float(ratio)}, source=TORCH_SOURCE,
                        class_name="SwitchRouter")
