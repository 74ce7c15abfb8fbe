"""Router families, found by name (`model.router.type`): one module each, in this package or in a
researcher's own file loaded with `plugins=` (docs/extending.md). A family's Flax module returns
`(plan, metrics)`, `plan` (`Plan`) a pytree whose every array has the G groups first, so that
expert parallelism shards it like the tokens. Outside this package no family is told apart by its
name: whatever differs is a `RouterFamily` hook."""
from __future__ import annotations

from runner.models.moe.routers.base import (DEFAULT, LOSSES, Plan, RouterFamily, TorchRouting,
                                            family, register, split_losses, weighted_losses)
# The built-in families register themselves when their modules are imported.
from runner.models.moe.routers import experts_choice, soft, token_choice  # noqa: F401

__all__ = ["DEFAULT", "LOSSES", "Plan", "RouterFamily", "TorchRouting", "family", "register",
           "split_losses", "weighted_losses"]
