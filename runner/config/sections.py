"""The schema sections that take keys declared elsewhere, made once.

A router family declares its `model.router.*` keys in its own dataclass, an optimizer its
`optim.*` keys, a schedule its `schedule.*` keys (`declare`), an evaluator its `eval.*` keys
(`add_fields`). The sections that take them (`RouterConfig`, `OptimConfig`, `ScheduleConfig`,
`EvalSuiteConfig` and what derives from or copies them) are declared `@open_section` with the
keys they read themselves, and are not dataclasses yet: registering adds its keys to a list.
`complete()` then makes each one a dataclass, once, with its own keys followed by the declared
ones in registration order. It runs at the schema's first use: the Hydra store (before any
composition), or the first section made. So the modules register (the built-ins by
`runner.builtins.register()`, a plug-in's from `plugins=`) before any config exists, and keys
declared after that are refused rather than added to classes already in use.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Optional

from runner.errors import ConfigError

_OPEN: list[type] = []  # in declaration order: a base before what derives from it
_OWN: dict[type, dict[str, object]] = {}  # section -> its class body's keys and their defaults
_DECLARED: dict[type, dict[str, tuple[type, dataclasses.Field]]] = {}
# section -> its all-optional copies (schema.optional_copy: eval's "unchanged unless given" model
# overrides), which take each declared key too, as Optional and None by default.
_OPTIONAL_COPIES: dict[type, list[type]] = {}
_completed = False


def _first_use(self, *args, **kwargs):
  """An open section's constructor until `complete()`: making one is the schema's first use."""
  complete()
  type(self).__init__(self, *args, **kwargs)


def open_section(cls):
  """Declares `cls` (a class with annotated keys, as for `@dataclass`) a section that takes
  declared keys; `complete()` makes it a dataclass."""
  cls.__init__ = _first_use
  _OPEN.append(cls)
  _OWN[cls] = {name: cls.__dict__.get(name, dataclasses.MISSING)
               for name in cls.__dict__.get("__annotations__", {})}
  _DECLARED[cls] = {}
  return cls


def is_open(cls) -> bool:
  return cls in _DECLARED


def own_keys(cls) -> tuple[str, ...]:
  """The keys the class body of the open section `cls` declares (not those registered)."""
  return tuple(_OWN[cls])


def _own(cls) -> dict[str, tuple[type, dataclasses.Field]]:
  """The keys the class body of the open section `cls` declares."""
  hints = typing.get_type_hints(cls)
  return {name: (hints[name], value if isinstance(value, dataclasses.Field)
                 else dataclasses.field(default=value)) for name, value in _OWN[cls].items()}


def fields_of(cls) -> dict[str, tuple[type, dataclasses.Field]]:
  """name -> (type, field) of an open section, its own keys then the declared ones, before or
  after `complete()`."""
  found = {}
  for klass in reversed(cls.__mro__):
    if klass in _DECLARED:
      found.update(_own(klass))
      found.update(_DECLARED[klass])
  return found


def mirror(cls, optional_copy) -> None:
  _OPTIONAL_COPIES.setdefault(cls, []).append(optional_copy)


def optional_copy(cls, name: str):
  """An open section named `name` with every key of the open section `cls` optional and None by
  default, taking each key declared to `cls` as well."""
  fields = {key: (Optional[kind], dataclasses.field(default=None, metadata=f.metadata))
            for key, (kind, f) in _own(cls).items()}
  copy = type(name, (), {"__module__": cls.__module__, "__annotations__": {key: kind for key, (kind, _) in fields.items()},
                         **{key: f for key, (_, f) in fields.items()}})
  open_section(copy)
  mirror(cls, copy)
  return copy


def add_fields(cls, fields: dict[str, tuple[type, dataclasses.Field]], *, owner: str) -> None:
  """Adds `name -> (type, dataclasses.field(...))` to the open section `cls`; `owner` names the
  declaring one in the error if the schema is already in use. A key declared already (the same
  module registering again) is kept as it was."""
  fields = {name: value for name, value in fields.items() if name not in _DECLARED[cls]}
  if not fields:
    return
  if _completed:
    raise ConfigError(
        f"{owner} declares keys ({', '.join(fields)}) after the schema was made (a config was "
        "already composed or made in this process): register it when its module is imported, "
        "before any config exists — load the module with plugins=[...], or import it first in a "
        "script of your own.")
  for copy in _OPTIONAL_COPIES.get(cls, []):
    add_fields(copy, {name: (Optional[kind], dataclasses.field(default=None,
                                                               metadata=field.metadata))
                      for name, (kind, field) in fields.items()}, owner=owner)
  _DECLARED[cls].update(fields)


def complete() -> None:
  """Makes every open section a dataclass, once: its own keys, then the declared ones."""
  global _completed
  if _completed:
    return
  _completed = True
  for cls in _OPEN:
    annotations = cls.__dict__.get("__annotations__")
    if annotations is None:
      annotations = cls.__annotations__ = {}
    for name, (kind, field) in _DECLARED[cls].items():
      annotations[name] = kind  # the type itself, not a string: typing.get_type_hints takes both
      setattr(cls, name, field)
    del cls.__init__  # _first_use: the dataclass writes the constructor
    dataclasses.dataclass(cls)


def declare(section, Config, *, owner: str, prefix: str, chooser: str, noun: str,
            nouns: str) -> tuple[str, ...]:
  """Adds the fields of `Config` (a dataclass: the keys one router family, optimizer or schedule
  reads) to the open section `section`, whose key `chooser` chooses among them; returns their
  names. A key the section declares itself cannot be declared again, and a key that several
  declare must have the same type and default in each. `owner` names the declaring one in errors
  ("router family 'soft'"), `prefix` the section's keys ("model.router"), `noun`/`nouns` its
  kind ("family"/"families")."""
  own = _own(section)
  declared = _DECLARED[section]
  hints = typing.get_type_hints(Config)
  new = {}
  for f in dataclasses.fields(Config):
    if f.name in own:
      which = f"chooses the {noun}" if f.name == chooser else f"every {noun} reads"
      raise ConfigError(f"{owner} declares the key `{f.name}`, which {which}: rename it.")
    if f.name in declared:
      kind, before = declared[f.name]
      if hints[f.name] != kind or default_of(f) != default_of(before):
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
  add_fields(section, new, owner=owner)
  return tuple(f.name for f in dataclasses.fields(Config))


def default_of(f: dataclasses.Field):
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return f.default
