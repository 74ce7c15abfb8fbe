"""Checks a typed config once, before any compute: every field's declared check, then the relations.

Relations run only on configs whose fields are each valid: a relation over a bad value would only
repeat the problem.
"""
from __future__ import annotations

import dataclasses
import types

from runner.config.relations import RELATIONS
from runner.errors import ConfigError


def _sections(node):
  """(name, value, field metadata) of a dataclass, or of a namespace of sections."""
  if dataclasses.is_dataclass(node) and not isinstance(node, type):
    return [(f.name, getattr(node, f.name), f.metadata) for f in dataclasses.fields(node)]
  if isinstance(node, types.SimpleNamespace):
    return [(name, value, {}) for name, value in vars(node).items()]
  return []


def field_problems(node, prefix: str = "") -> list[str]:
  """The declared check of every field, depth first, in schema order."""
  found = []
  for name, value, metadata in _sections(node):
    path = f"{prefix}{name}"
    if dataclasses.is_dataclass(value) or isinstance(value, types.SimpleNamespace):
      found += field_problems(value, path + ".")
      continue
    check = metadata.get("check")
    if check is None or value is None:
      continue
    if problem := check(value):
      hint = metadata.get("hint")
      shown = repr(value) if isinstance(value, str) else str(value)
      found.append(f"{path}={shown} {problem}" + (f" ({hint})" if hint else ""))
  return found


def problems(config, devices: int | None = None, checkpoints=None, *,
             device_checks_only: bool = False) -> list[str]:
  """Everything wrong with `config`. Before launch the CLI checks what needs no devices; the job
  then checks only what does (`device_checks_only`)."""
  found = [] if device_checks_only else field_problems(config)
  members = getattr(config, "members", None) or []
  for member in members:
    where = f"checkpoint {member.path}: " if len(members) > 1 else ""
    found += [where + p for p in problems(types.SimpleNamespace(model=member.model), devices,
                                          device_checks_only=device_checks_only)]
  if found:
    return found
  for relation in RELATIONS:
    if device_checks_only and not relation.needs_devices:
      continue
    args = relation.arguments(config, devices, checkpoints)
    if args is None:
      continue
    try:
      problem = relation.fn(**args)
    except ValueError:  # a value another relation reports (e.g. an invalid model.moe.layers)
      continue
    if problem:
      found.append(problem.rstrip("."))
  return found


def paragraph(found: list[str]) -> str:
  if len(found) == 1:
    return found[0].rstrip(".") + "."
  return f"{len(found)} problems in the config: " + "; ".join(p.rstrip(".") for p in found) + "."


def validate(config, devices: int | None = None, checkpoints=None, *,
             device_checks_only: bool = False):
  """Returns `config` unchanged, or raises one ConfigError listing every problem."""
  if found := problems(config, devices, checkpoints, device_checks_only=device_checks_only):
    raise ConfigError(paragraph(found))
  return config
