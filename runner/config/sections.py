"""The schema sections that take keys declared elsewhere, made once, fresh.

Router families, optimizers and schedules `declare` their keys, evaluators `add_fields` theirs, to
an `@open_section` (`RouterConfig`, `OptimConfig`, ...): a dataclass holding no key, never changed.
`build()` then makes, once per process, a fresh subclass of each with its own keys followed by
the declared ones, which the schema's fields default to (`made`), Hydra and the resolver type
configs with, and code makes values of (`new`). It runs at the schema's first use, so modules
register before any config exists; a key declared after that is refused with its name.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Optional

from runner.errors import ConfigError

_OPEN: list[type] = []  # in declaration order: a base before what derives from it
_OWN: dict[type, dict[str, object]] = {}  # section -> its class body's keys and their defaults
_BODY: dict[type, type] = {}  # section -> the class as declared, whose annotations type its keys
_DECLARED: dict[type, dict[str, tuple[type, dataclasses.Field]]] = {}
# section -> its all-optional copies (schema.optional_copy: eval's "unchanged unless given" model
# overrides), which take each declared key too, as Optional and None by default.
_OPTIONAL_COPIES: dict[type, list[type]] = {}
_BUILT: dict[type, type] = {}  # section -> the class `build` made of it, once
_made = False  # whether `build` ran: from then on no key may be declared
# Where pickle finds a built class by name: (module, attribute); `pickled_as` moves it.
_home = (__name__, "BUILT")


def open_section(cls):
  """Makes `cls` (annotated keys, as for `@dataclass`) a section that takes declared keys: a
  dataclass holding none, whose keys are the fields of the subclass `build` makes of it (so `cls`
  still names the section in annotations and isinstance)."""
  own = {name: cls.__dict__.get(name, dataclasses.MISSING)
         for name in cls.__dict__.get("__annotations__", {})}
  body = {k: v for k, v in cls.__dict__.items()
          if k not in own and k not in ("__annotations__", "__dict__", "__weakref__")}
  body["__annotations__"] = {}
  section = dataclasses.dataclass(type(cls.__name__, cls.__bases__, body))
  _BODY[section] = cls
  _OPEN.append(section)
  _OWN[section] = own
  _DECLARED[section] = {}
  return section


def is_open(cls) -> bool:
  return cls in _DECLARED


def own_keys(cls) -> tuple[str, ...]:
  """The keys the class body of the open section `cls` declares (not those registered)."""
  return tuple(_OWN[cls])


def _own(cls) -> dict[str, tuple[type, dataclasses.Field]]:
  """The keys the class body of the open section `cls` declares."""
  hints = typing.get_type_hints(_BODY[cls])
  return {name: (hints[name], _copy(value) if isinstance(value, dataclasses.Field)
                 else dataclasses.field(default=value)) for name, value in _OWN[cls].items()}


def _copy(f: dataclasses.Field) -> dataclasses.Field:
  """A field's declaration again, so that each class made from it gets a field of its own."""
  if f.default_factory is not dataclasses.MISSING:
    return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
  return dataclasses.field(default=f.default, metadata=f.metadata)


def fields_of(cls) -> dict[str, tuple[type, dataclasses.Field]]:
  """name -> (type, field) of an open section, its own keys then the declared ones, for each
  open section it derives from first."""
  found = {}
  for klass in reversed(cls.__mro__):
    if klass in _DECLARED:
      found.update(_own(klass))
      found.update(_DECLARED[klass])
  return found


def optional_copy(cls, name: str):
  """An open section named `name` with every key of the open section `cls` optional and None by
  default, taking each key declared to `cls` as well."""
  fields = _optional(_own(cls))
  copy = type(name, (), {"__module__": cls.__module__,
                         "__annotations__": {key: kind for key, (kind, _) in fields.items()},
                         **{key: f for key, (_, f) in fields.items()}})
  copy = open_section(copy)
  _OPTIONAL_COPIES.setdefault(cls, []).append(copy)
  return copy


def add_fields(cls, fields: dict[str, tuple[type, dataclasses.Field]], *, owner: str) -> None:
  """Adds `name -> (type, field)` to the open section `cls` (and its optional copies); a key
  declared already (a module registering again) is kept as it was."""
  fields = {name: value for name, value in fields.items() if name not in _DECLARED[cls]}
  if not fields:
    return
  if _made:
    raise ConfigError(
        f"{owner} declares keys ({', '.join(fields)}) after the schema was made (a config was "
        "already composed or made in this process): register it when its module is imported, "
        "before any config exists — load the module with plugins=[...], or import it first in a "
        "script of your own.")
  for copy in _OPTIONAL_COPIES.get(cls, []):
    add_fields(copy, _optional(fields), owner=owner)
  _DECLARED[cls].update(fields)


def _optional(fields: dict[str, tuple[type, dataclasses.Field]]) -> dict:
  """The same keys, each Optional and None by default (an optional copy's), checked as before."""
  return {key: (Optional[kind], dataclasses.field(default=None, metadata=f.metadata))
          for key, (kind, f) in fields.items()}


def build() -> None:
  """Makes, once, a fresh dataclass of every open section: a subclass of it (and of what `build`
  made of the open section it derives from), its own keys then the declared ones."""
  global _made
  if _made:
    return
  _made = True
  for cls in _OPEN:
    parents = [_BUILT[b] for b in cls.__bases__ if b in _BUILT]
    keys = {**_own(cls), **_DECLARED[cls]}
    _BUILT[cls] = dataclasses.make_dataclass(
        cls.__name__, [(name, kind, field) for name, (kind, field) in keys.items()],
        bases=(*parents, cls), namespace={"__module__": _home[0],
                                          "__qualname__": f"{_home[1]}.{cls.__name__}",
                                          "__doc__": cls.__doc__})


class Finder:
  """Where pickle finds a built class by name (`<module>.<attribute>.RouterConfig`): a config
  composed in one process and unpickled in a job's own, where nothing may have built yet."""

  def __getattr__(self, name: str) -> type:
    build()
    for made in _BUILT.values():
      if made.__name__ == name:
        return made
    raise AttributeError(name)


BUILT = Finder()


def pickled_as(module: str, attribute: str) -> None:
  """Makes pickle find the built classes at `module`.`attribute` (a Finder that registers what
  a job needs before it builds: runner/builtins.py); before the build only."""
  global _home
  if _made:
    raise RuntimeError("the schema is built already: its classes say where they are found")
  _home = (module, attribute)


def is_built() -> bool:
  """Whether this process has made the schema."""
  return _made


def built(cls) -> type:
  """The class `build` made of the open section `cls` (making the schema, if nothing has yet)."""
  build()
  return _BUILT[cls]


def new(cls, **keys):
  """A value of the open section `cls` (its built class's), with `keys` set."""
  return built(cls)(**keys)


def fields_class(cls) -> type:
  """The class whose fields a value annotated `cls` has: the built class of an open section (the
  section itself holds none), else `cls`."""
  return built(cls) if is_open(cls) else cls


def made(cls):
  """A default_factory for a field holding the open section `cls`: an instance of its built class,
  the schema made at that first use."""
  def make():
    return built(cls)()
  make.__qualname__ = f"made({cls.__name__})"
  return make


def declare(section, Config, *, owner: str, prefix: str, chooser: str, noun: str,
            nouns: str) -> tuple[str, ...]:
  """Adds the fields of `Config` (the keys one router family, optimizer or schedule reads) to
  `section`, whose key `chooser` chooses among them; returns their names. A key shared by several
  must have one type and default. `owner`, `prefix`, `noun`/`nouns` word the errors ("router
  family 'soft'", "model.router", "family"/"families")."""
  own = _OWN[section]
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
    new[f.name] = (hints[f.name], _copy(f))
  add_fields(section, new, owner=owner)
  return tuple(f.name for f in dataclasses.fields(Config))


def default_of(f: dataclasses.Field):
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return f.default
