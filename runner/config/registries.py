"""The names a config may choose, and what each stands for: router families, evaluators,
optimizers, schedules.

The config layer holds the tables; the modules that define the things fill them when they are
imported (the built-in ones with their package, a plug-in's from `plugins=`). So the schema and
the relations check a name against everything registered without importing models or training
code, and a plug-in's name is valid exactly like a built-in one.
"""
from __future__ import annotations

from typing import Generic, Iterator, TypeVar

from runner.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
  """Named entries of one kind, in registration order (the built-in ones first)."""

  def __init__(self, kind: str, key: str):
    self.kind = kind  # e.g. "router family"
    self.key = key  # the config key that chooses one, e.g. "model.router.type"
    self._entries: dict[str, T] = {}

  def add(self, name: str, entry: T) -> T:
    """Registers `entry` as `name`; registering another entry under a taken name is an error
    (the same entry again, as a module imported twice, is not)."""
    known = self._entries.get(name)
    if known is not None and known is not entry and _origin(known) != _origin(entry):
      raise ConfigError(f"{self.kind} {name!r} is registered twice ({_origin(known)} and "
                        f"{_origin(entry)}): give the new one another name.")
    self._entries[name] = entry
    return entry

  def get(self, name: str) -> T:
    name = str(getattr(name, "value", name))
    if name not in self._entries:
      raise ConfigError(f"{self.key}={name!r} is not a known {self.kind}; valid: "
                        f"{', '.join(self._entries)} (a plug-in's with plugins=[<its module>]).")
    return self._entries[name]

  def names(self) -> list[str]:
    return list(self._entries)

  def items(self) -> Iterator[tuple[str, T]]:
    return iter(list(self._entries.items()))

  def __contains__(self, name) -> bool:
    return str(getattr(name, "value", name)) in self._entries


def _origin(entry) -> str:
  return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', type(entry).__name__)}"


ROUTERS: Registry = Registry("router family", "model.router.type")
EVALUATORS: Registry = Registry("evaluator", "eval.*")
OPTIMIZERS: Registry = Registry("optimizer", "optim.name")
SCHEDULES: Registry = Registry("schedule", "schedule.name")
