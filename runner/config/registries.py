"""The names a config may choose. The config layer holds the tables and the modules that define
the things fill them when imported, so that a name is checked without importing models or
training code, and a plug-in's name is valid exactly like a built-in one.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

from runner.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
  """Named entries of one kind, in registration order (the built-in ones first)."""

  def __init__(self, kind: str, key: str):
    self.kind = kind  # e.g. "router family"
    self.key = key  # the config key that chooses one, e.g. "model.router.type"
    self._entries: dict[str, T] = {}

  def check(self, name: str, entry) -> None:
    """Raises if `name` is taken by another entry (the same entry again, as a module imported
    twice, is not)."""
    known = self._entries.get(name)
    if known is not None and known is not entry and _origin(known) != _origin(entry):
      raise ConfigError(f"{self.kind} {name!r} is registered twice ({_origin(known)} and "
                        f"{_origin(entry)}): give the new one another name.")

  def add(self, name: str, entry: T) -> T:
    self.check(name, entry)
    self._entries[name] = entry
    return entry

  def get(self, name: str) -> T:
    name = str(name)
    if name not in self._entries:
      raise ConfigError(f"{self.key}={name!r} is not a known {self.kind}; valid: "
                        f"{', '.join(self._entries)} (a plug-in's with plugins=[<its module>]).")
    return self._entries[name]

  def names(self) -> list[str]:
    return list(self._entries)

  def items(self) -> Iterator[tuple[str, T]]:
    return iter(list(self._entries.items()))

  def __contains__(self, name) -> bool:
    return str(name) in self._entries

  def __iter__(self) -> Iterator[str]:
    return iter(self.names())


def _origin(entry) -> str:
  entry = getattr(entry, "fn", entry)  # a Registered function: where the function is
  return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', type(entry).__name__)}"


@dataclasses.dataclass(frozen=True)
class Registered:
  """A function registered by name (an optimizer's preconditioner, a schedule's rate) with what
  it declares, as a router family does (runner/config/components.py `register`)."""
  fn: Callable[..., Any]
  Config: Optional[type] = None
  options: tuple[str, ...] = ()  # the Config's field names
  problem: Optional[Callable[..., Optional[str]]] = None
  reads: tuple[str, ...] = ()

  def values(self, given: dict) -> dict:
    """The keys it reads, from `given` (a section's fields, or keyword arguments), else their
    defaults: what `fn` is called with."""
    if self.Config is None:
      return {}
    config = self.Config(**{name: given[name] for name in self.options if name in given})
    return {name: getattr(config, name) for name in self.options}


ROUTERS: Registry = Registry("router family", "model.router.type")
EVALUATORS: Registry = Registry("evaluator", "eval.*")
OPTIMIZERS: Registry = Registry("optimizer", "optim.name")
SCHEDULES: Registry = Registry("schedule", "schedule.name")
