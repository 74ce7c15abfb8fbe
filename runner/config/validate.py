"""Checks that a composed config makes sense, before any data is read or anything is compiled."""
from __future__ import annotations

import re

import jax

from runner.errors import ConfigError
from runner.models import catalog


def check_model(model: dict) -> None:
  moe, router = model.get("moe") or {}, model.get("router") or {}
  if model["hidden_size"] % model["num_heads"]:
    raise ConfigError(f"model.hidden_size={model['hidden_size']} is not divisible by "
                      f"model.num_heads={model['num_heads']}.")
  if model["image_size"] % model["patch_size"]:
    raise ConfigError(f"model.image_size={model['image_size']} is not divisible by "
                      f"model.patch_size={model['patch_size']}.")
  try:
    layers = catalog.moe_layer_indices(moe.get("layers") or [], model["num_layers"])
  except ValueError as e:
    raise ConfigError(str(e)) from None
  experts = moe.get("num_experts") or 0
  if layers and experts < 1:
    raise ConfigError(f"model.moe.layers={moe.get('layers')} needs model.moe.num_experts >= 1.")
  if not layers or not experts:
    return
  k = router.get("k", 2)
  if not 1 <= k <= experts:
    raise ConfigError(f"model.router.k={k} selects more experts per token than there are "
                      f"(model.moe.num_experts={experts}); valid: 1 <= k <= {experts}.")
  for key in ("capacity_ratio", "eval_capacity_ratio"):
    if router.get(key) is not None and router[key] <= 0:
      raise ConfigError(f"model.router.{key}={router[key]} must be > 0 (1.05 upstream; smaller "
                        "values drop tokens, which Batch Prioritized Routing makes graceful).")
  if moe.get("group_size", 8) < 1:
    raise ConfigError("model.moe.group_size (images per routing group) must be >= 1.")


def check_optim(optim: dict) -> None:
  """optim.weight_decay: a number, or a list of [regex, number] pairs."""
  wd = optim.get("weight_decay", 0.0)
  if isinstance(wd, (int, float)) and not isinstance(wd, bool):
    return
  hint = ("optim.weight_decay must be a number or a list of [regex, value] pairs, e.g. "
          "'optim.weight_decay=[[head/kernel,3.0],[.*kernel,0.03]]'")
  if not isinstance(wd, (list, tuple)):
    raise ConfigError(f"{hint}; got {wd!r}.")
  for rule in wd:
    if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)
            and isinstance(rule[1], (int, float))):
      raise ConfigError(f"{hint}; got the rule {rule!r}.")
    try:
      re.compile(rule[0])
    except re.error as e:
      raise ConfigError(f"optim.weight_decay pattern {rule[0]!r} is not a regular expression: "
                        f"{e}.") from None


def check_batch(batch_size: int, model: dict, *, what: str = "data.batch_size",
                accum_steps: int = 1) -> None:
  devices = jax.device_count()
  if batch_size % devices:
    raise ConfigError(f"{what}={batch_size} is not divisible by the {devices} devices; use a "
                      f"multiple of {devices}.")
  if accum_steps < 1 or batch_size % accum_steps:
    raise ConfigError(f"train.accum_steps={accum_steps} must divide {what}={batch_size}.")
  micro = batch_size // accum_steps
  moe = model.get("moe") or {}
  if moe.get("num_experts") and moe.get("layers"):
    group = moe.get("group_size", 8)
    per_device = micro // devices
    fits = per_device % group == 0 if devices > 1 else (per_device % group == 0 or per_device < group)
    if not fits:
      raise ConfigError(
          f"{what}={batch_size} gives {per_device} images per device and micro-batch "
          f"({devices} device(s), train.accum_steps={accum_steps}); routing groups of "
          f"model.moe.group_size={group} images must tile each device's share: use a multiple of "
          f"{group * devices * accum_steps} images, or a group size dividing {per_device}.")
