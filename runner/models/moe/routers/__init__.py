"""Router families, found by name (`model.router.type`): one module each, one registry line here.

A router decides how the tokens of a routing group reach expert slots and how the slots' outputs
combine back into tokens. Each family module holds three things:

- a Flax module: `(tokens (G, S, D), *, train) -> (plan, metrics)`, where `metrics` holds the
  layer's scalars (always `auxiliary_loss` and `fraction_dropped_tokens`) and `plan` is a pytree
  whose every array has the G groups first (so expert parallelism can shard it like the tokens),
  with `num_experts` and `capacity` (slots per expert in one group) and the methods of `Plan`;
- a `RouterFamily` subclass: which `model.router.*` keys the family reads, what it supports
  (ensembles, Batch Prioritized Routing, a capacity changed at inference), and what it costs
  (slots, router FLOPs, experts used per token), so that config checks, FLOP counting, the
  capacity sweep and evaluators ask the router instead of reading `router.k`;
- its tests (tests/unit/test_moe_<family>.py).

The MoE layer (layer.py) only calls `plan.dispatch`, runs the experts on the (E, G, C, D)
buffers, and calls `plan.combine`.
"""
from __future__ import annotations

import importlib
from typing import Protocol

import jax


class Plan(Protocol):
  """What a router returns besides its metrics (see the module docstring)."""
  num_experts: int
  capacity: int

  def dispatch(self, x: jax.Array, method: str) -> jax.Array:
    """(G, S, D) tokens -> (E, G, C, D) expert buffers."""

  def combine(self, y: jax.Array, method: str) -> jax.Array:
    """(E, G, C, D) expert outputs -> (G, S, D) tokens."""

  def expert_weights(self) -> jax.Array:
    """(G, S, E) the weight each token gives each expert: the routing gates, or for a soft
    router each token's share of its dispatch mass per expert (rows sum to 1)."""

  def expert_mask(self, routed: bool) -> jax.Array | None:
    """(G, S, E) bool: the experts a token chose (`routed=False`), or the experts that process
    it after capacity (`routed=True`); None for a router without discrete choices (soft)."""


class RouterFamily:
  """A router family's answers to the rest of vmoe; `router` is the `model.router` config."""
  name: str = ""
  module: type  # the Flax module class
  options: tuple[str, ...] = ()  # the model.router.* keys this family reads (besides `type`)
  supports_ensembles: bool = False  # partitioned batch ensembles (E³)
  supports_batch_priority: bool = False
  capacity_at_inference: bool = True  # eval may change the capacity ratio (capacity sweeps)
  discrete: bool = True  # tokens go to chosen experts (PGD routing change is defined)
  uses_dispatcher: bool = True  # model.moe.dispatcher (indices or einsum) applies
  summary: str = ""  # one line for error messages and docs

  @classmethod
  def module_kwargs(cls, router, *, tokens: int, experts: int) -> dict:
    """The Flax module's keyword arguments (besides num_experts) from the config; `tokens` are
    those of a full routing group, `experts` the layer's."""
    raise NotImplementedError

  @classmethod
  def capacity(cls, router, tokens: int, experts: int, *, train: bool) -> int:
    """Slots per expert for a routing group of `tokens` tokens."""
    raise NotImplementedError

  @classmethod
  def router_flops(cls, tokens: int, dim: int, experts: int, capacity: int) -> float:
    """Matmul FLOPs of routing one group (gates, and for soft routers the two mixing einsums)."""
    return 2.0 * tokens * dim * experts

  @classmethod
  def experts_per_token(cls, router, tokens: int, experts: int, capacity: int) -> float:
    """How many experts' parameters one token uses on average (active parameters)."""
    raise NotImplementedError


# name -> module under runner/models/moe/routers/ defining FAMILY; one line per router.
REGISTRY = {
    "token_choice": "token_choice",
    "experts_choice": "experts_choice",
    "soft": "soft",
}
DEFAULT = "token_choice"


def names() -> list[str]:
  return list(REGISTRY)


def family(name: str | None) -> type[RouterFamily]:
  """The family registered as `name` (None: the default, token-choice)."""
  name = str(getattr(name, "value", name) or DEFAULT)
  if name not in REGISTRY:
    raise ValueError(f"unknown router type {name!r}; valid: {', '.join(REGISTRY)}")
  return importlib.import_module(f"{__name__}.{REGISTRY[name]}").FAMILY
