"""Command-line `model.*` keys on top of the model config stored with a checkpoint.

Stages that read a checkpoint (eval, fewshot) take their model from it; the optional keys given
on the command line (schema.ModelOverrides: None = unchanged) change inference settings such as
the router's k, capacity and Batch Prioritized Routing.
"""
from __future__ import annotations

import copy


def prune_none(tree):
  """The tree without None leaves and without the sub-trees left empty by that."""
  if isinstance(tree, dict):
    pruned = {k: prune_none(v) for k, v in tree.items() if v is not None}
    return {k: v for k, v in pruned.items() if v != {}}
  return tree


def merged(base: dict, changes: dict) -> dict:
  """A deep copy of `base` with `changes` written over it (dicts merged, anything else replaced)."""
  out = copy.deepcopy(base)
  for key, value in changes.items():
    if isinstance(value, dict) and isinstance(out.get(key), dict):
      out[key] = merged(out[key], value)
    else:
      out[key] = copy.deepcopy(value)
  return out


def model_with_overrides(stored: dict, given: dict | None) -> dict:
  """The stored model config with the given non-null keys on top.

  At inference the capacity ratio that matters is `eval_capacity_ratio`, so a given
  `router.capacity_ratio` sets it too unless `router.eval_capacity_ratio` is given as well.
  """
  changes = prune_none(copy.deepcopy(given or {}))
  router = changes.get("router") or {}
  if "capacity_ratio" in router and "eval_capacity_ratio" not in router:
    router["eval_capacity_ratio"] = router["capacity_ratio"]
  return merged(stored, changes)
