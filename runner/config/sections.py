"""Keys that a router family, an optimizer, a schedule or an evaluator declares in its own
module, added to the schema.

A router family declares its `model.router.*` keys in its own dataclass, an optimizer its
`optim.*` keys, a schedule its `schedule.*` keys (`declare`), an evaluator its `eval.<name>.*`
section; registering one adds those fields to the schema class they belong to (`RouterConfig`,
`OptimConfig`, `ScheduleConfig`, `EvalSuiteConfig`), in place, so every reference to that class
(Hydra's typed nodes, `isinstance` checks, the classes derived from it) sees them. Registration
happens when the module is imported: the built-in ones by `runner.builtins.register()`, a
plug-in's from `plugins=` before any config is composed.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Optional

from runner.errors import ConfigError

# What `dataclasses.dataclass` writes on a class; removed before the class is processed again.
_GENERATED = ("__init__", "__repr__", "__eq__", "__hash__", "__match_args__",
              "__dataclass_fields__", "__dataclass_params__", "__slots__")


def _reprocess(cls, new: dict[str, dataclasses.Field] | None = None) -> None:
  """Runs `dataclasses.dataclass` over `cls` again, keeping each field it declares as it was
  declared (plus the `new` ones, already in its annotations), then over its subclasses."""
  declared = {f.name: f for f in dataclasses.fields(cls)}
  declared.update(new or {})
  for name in cls.__dict__.get("__annotations__", {}):  # inherited fields stay the base's
    setattr(cls, name, declared[name])
  for name in _GENERATED:
    if name in cls.__dict__ and name != "__slots__":
      delattr(cls, name)
  dataclasses.dataclass(cls)
  for sub in cls.__subclasses__():  # they collected the base's fields when they were made
    if dataclasses.is_dataclass(sub):
      _reprocess(sub)


# class -> its all-optional copies (schema.optional_copy: eval's "unchanged unless given" model
# overrides), which gain each new key too, as Optional and None by default.
_OPTIONAL_COPIES: dict[type, list[type]] = {}


def mirror(cls, optional_copy) -> None:
  _OPTIONAL_COPIES.setdefault(cls, []).append(optional_copy)


def add_fields(cls, fields: dict[str, tuple[type, dataclasses.Field]]) -> None:
  """Adds `name -> (type, dataclasses.field(...))` to the dataclass `cls` and its subclasses."""
  if not fields:
    return
  for copy in _OPTIONAL_COPIES.get(cls, []):
    add_fields(copy, {name: (Optional[kind], dataclasses.field(default=None,
                                                               metadata=field.metadata))
                      for name, (kind, field) in fields.items()})
  annotations = cls.__dict__.get("__annotations__")
  if annotations is None:
    annotations = cls.__annotations__ = {}
  for name, (kind, _) in fields.items():
    annotations[name] = kind  # the type itself, not a string: typing.get_type_hints takes both
  _reprocess(cls, {name: field for name, (_, field) in fields.items()})


# section -> the keys it declares itself (read by every family, optimizer, ...), before any was added.
_OWN: dict[type, tuple[str, ...]] = {}


def declare(section, Config, *, owner: str, prefix: str, chooser: str, noun: str,
            nouns: str) -> tuple[str, ...]:
  """Adds the fields of `Config` (a dataclass: the keys one router family, optimizer or schedule
  reads) to the schema class `section`, whose key `chooser` chooses among them; returns their
  names. A key the section declares itself cannot be declared again, and a key that several
  declare must have the same type and default in each. `owner` names the declaring one in errors
  ("router family 'soft'"), `prefix` the section's keys ("model.router"), `noun`/`nouns` its
  kind ("family"/"families")."""
  own = _OWN.setdefault(section, tuple(f.name for f in dataclasses.fields(section)))
  declared = {f.name: f for f in dataclasses.fields(section)}
  declared_types = typing.get_type_hints(section)
  hints = typing.get_type_hints(Config)
  new = {}
  for f in dataclasses.fields(Config):
    if f.name in own:
      which = f"chooses the {noun}" if f.name == chooser else f"every {noun} reads"
      raise ConfigError(f"{owner} declares the key `{f.name}`, which {which}: rename it.")
    if f.name in declared:
      if (hints[f.name] != declared_types[f.name]
          or default_of(f) != default_of(declared[f.name])):
        article = "an" if noun[0] in "aeiou" else "a"
        raise ConfigError(
            f"{owner} declares {prefix}.{f.name} with another type or default than {article} "
            f"{noun} registered before it: a key shared by {nouns} must mean the same; rename "
            "it, or give it the same type and default.")
      continue
    kwargs = dict(metadata=f.metadata)
    if f.default_factory is not dataclasses.MISSING:
      kwargs["default_factory"] = f.default_factory
    else:
      kwargs["default"] = f.default
    new[f.name] = (hints[f.name], dataclasses.field(**kwargs))
  add_fields(section, new)
  return tuple(f.name for f in dataclasses.fields(Config))


def default_of(f: dataclasses.Field):
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return f.default
