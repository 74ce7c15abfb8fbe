"""Router families, found by name (`model.router.type`): one module each, in this package or in a
researcher's own file loaded with `plugins=` (docs/extending.md).

A router decides how the tokens of a routing group reach expert slots and how the slots' outputs
combine back into tokens. Each family module holds:

- a Flax module: `(tokens (G, S, D), *, train) -> (plan, metrics)`, where `metrics` holds the
  layer's scalars (always `auxiliary_loss` and `fraction_dropped_tokens`) and `plan` is a pytree
  whose every array has the G groups first (so expert parallelism can shard it like the tokens),
  with `num_experts` and `capacity` (slots per expert in one group) and the methods of `Plan`;
- a `Config` dataclass: the `model.router.*` keys the family reads, each with its type, default,
  check and hint (runner/config/checks.py `key`);
- a `RouterFamily` subclass, registered with `@register`: what it supports
  (ensembles, Batch Prioritized Routing, a capacity changed at inference), and what it costs
  (slots, router FLOPs, experts used per token), so that config checks, FLOP counting, the
  capacity sweep and evaluators ask the router instead of reading `router.k`;
- its tests (tests/unit/test_moe_<family>.py).

The MoE layer (layer.py) calls `plan.dispatch`, runs the experts on the (E, G, C, D) buffers,
and calls `plan.combine`; what it sows for introspection it asks of the plan (`expert_weights`,
`expert_mask`) and of the family (`expert_ids`, `sown_records`). No family is told apart by its
name outside this package: whatever differs is a `RouterFamily` hook.
"""
from __future__ import annotations

from runner.models.moe.routers.base import (DEFAULT, Plan, RouterFamily, TorchRouting, family,
                                            register)
# The built-in families register themselves when their modules are imported.
from runner.models.moe.routers import experts_choice, soft, token_choice  # noqa: F401

__all__ = ["DEFAULT", "Plan", "RouterFamily", "TorchRouting", "family", "register"]
