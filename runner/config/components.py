"""One protocol for every component a config chooses by name, a built-in's as a plug-in's
(docs/extending.md: kinds, names, `Config`s, relations, hooks)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from runner.config import registries, sections
from runner.config.relations import changed_keys, relation
from runner.config.schema import OptimConfig, RouterConfig, ScheduleConfig
from runner.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Kind:
  """What every component of one kind shares. `registry.key` is the key that chooses one
  ("optim.name": the section's keys are `optim.*`, `name` chooses); `noun`/`nouns` name the kind
  in the messages of `sections.declare`."""
  registry: registries.Registry
  section: Optional[type] = None  # the open schema section its keys join; None: it has none
  noun: str = ""
  nouns: str = ""
  reads: tuple[str, ...] = ()  # the section's keys that every component of the kind reads
  # The registry holds `registries.Registered` records (a function with what it declares);
  # otherwise the value itself (a class that carries its own Config: a router family).
  records: bool = False
  # The keys a component brings itself, name -> (type, field), added as they are (an
  # evaluator's: eval.<key> and its section eval.<section>), instead of one `Config`.
  keys: Optional[Callable[[Any], dict]] = None

  @property
  def prefix(self) -> str:
    return self.registry.key.rpartition(".")[0]

  @property
  def chooser(self) -> str:
    return self.registry.key.rpartition(".")[2]


ROUTER = Kind(registries.ROUTERS, RouterConfig, noun="family", nouns="families")
OPTIMIZER = Kind(registries.OPTIMIZERS, OptimConfig, noun="optimizer", nouns="optimizers",
                 reads=("lr", "weight_decay", "grad_clip_norm"), records=True)
SCHEDULE = Kind(registries.SCHEDULES, ScheduleConfig, noun="schedule", nouns="schedules",
                reads=("warmup_steps",), records=True)


def register(kind: Kind, name: str, value, Config: Optional[type] = None, problem=None,
             reads: tuple[str, ...] = ()) -> tuple[str, ...]:
  """Adds `value` as `name` of `kind`, and returns the names of `Config`'s keys.

  The name is checked first, so that a refused component adds no key (docs/extending.md)."""
  kind.registry.check(name, value)
  owner = f"{kind.registry.kind} {name!r}"
  shared = [key for key in (sections.own_keys(kind.section) if reads and kind.section else ())
            if key != kind.chooser and key not in kind.reads]
  if unknown := [key for key in reads if key not in shared]:
    raise ConfigError(
        f"{owner} reads {', '.join(f'{kind.prefix}.{key}' for key in unknown)}, not a key of "
        f"{kind.prefix}.* that {_a(kind.noun)} may read besides its own (those are: "
        f"{', '.join(shared) or 'none'}): declare it in its Config.")
  options = () if Config is None else sections.declare(
      kind.section, Config, owner=owner, prefix=kind.prefix, chooser=kind.chooser,
      noun=kind.noun, nouns=kind.nouns)
  if kind.keys is not None:  # named by its class: its keys may clash with any other's
    sections.add_fields(kind.section, kind.keys(value),
                        owner=f"{kind.registry.kind} {value.__module__}.{value.__qualname__}")
  kind.registry.add(name, registries.Registered(value, Config, options, problem, tuple(reads))
                    if kind.records else value)
  return options


def _a(noun: str) -> str:
  return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def unread_keys(kind: Kind, section) -> Optional[str]:
  """A key of `section` (the kind's typed section) that the chosen component does not read is an
  error unless it keeps its default: a value that would change nothing is a mistake."""
  name = getattr(section, kind.chooser)
  chosen = kind.registry.get(name)
  keys = (*kind.reads, *chosen.reads, *chosen.options)
  given = changed_keys(section, kind.prefix, skip=(kind.chooser, *keys))
  if not given:
    return None
  return (f"{', '.join(given)} means nothing for {kind.registry.key}={name}; its keys are "
          f"{kind.prefix}.{{{', '.join(keys)}}}. Drop the other keys, or choose "
          f"{_a(kind.noun)} that reads them ({kind.registry.key}="
          f"{'|'.join(kind.registry.names())}).")


@relation
def optimizer_reads_its_keys(optim: OptimConfig):
  return unread_keys(OPTIMIZER, optim)


@relation
def schedule_reads_its_keys(schedule: ScheduleConfig):
  return unread_keys(SCHEDULE, schedule)
