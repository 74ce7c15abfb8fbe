"""What a config value may be, declared next to its field in the schema (`key(default, check)`).

Each check answers "what is wrong with this value" in words a user can act on ("must be >= 1"),
or None when the value is fine. None values of optional fields are "unset" and never checked.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import Any, Callable, Iterable


def key(default: Any, check: "Check | None" = None, hint: str = ""):
  """A schema field with its default, its check and a hint that the error message repeats."""
  metadata = {"check": check, "hint": hint}
  if isinstance(default, (list, dict)):
    return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


class Check:
  def __call__(self, value) -> str | None:
    raise NotImplementedError


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Range(Check):
  """low <= value <= high, either side open or absent."""
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False

  def __call__(self, value):
    if not _number(value):
      return f"must be a number {self.describe()}"
    ok = ((self.low is None or (value > self.low if self.low_open else value >= self.low))
          and (self.high is None or (value < self.high if self.high_open else value <= self.high)))
    if ok and not math.isfinite(value):  # inf (1e400 too) passes a range with no upper bound
      return f"must be finite and {self.describe()}"
    return None if ok else f"must be {self.describe()}"

  def describe(self) -> str:
    low, high = (f"{v:g}" if isinstance(v, float) else v for v in (self.low, self.high))
    if self.low is not None and self.high is not None:
      return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
    if self.low is not None:
      return f"{'>' if self.low_open else '>='} {low}"
    return f"{'<' if self.high_open else '<='} {high}"


def positive() -> Range:
  return Range(0, low_open=True)


def at_least(n: float) -> Range:
  return Range(n)


def probability() -> Range:
  return Range(0, 1)


def rate() -> Range:
  """A dropout rate or a moment decay: 1 would drop (or keep) everything."""
  return Range(0, 1, high_open=True)


@dataclasses.dataclass(frozen=True)
class Choice(Check):
  """One of a set of names; `choices` may be a function, so that heavy registries load lazily."""
  choices: tuple | Callable[[], Iterable[str]]

  def __call__(self, value):
    names = list(self.choices() if callable(self.choices) else self.choices)
    return None if value in names else f"must be one of {', '.join(map(str, names))}"


@dataclasses.dataclass(frozen=True)
class Items(Check):
  """A list whose items each pass `each`; optionally non-empty, strictly increasing, unique."""
  each: Check | None = None
  nonempty: bool = False
  increasing: bool = False
  unique: bool = False
  example: str = ""

  def __call__(self, value):
    shape = f" (e.g. {self.example})" if self.example else ""
    if not isinstance(value, (list, tuple)):
      return f"must be a list{shape}"
    if self.nonempty and not value:
      return f"must be a non-empty list{shape}"
    if self.each is not None:
      for item in value:
        if problem := self.each(item):
          return f"has the item {item!r}, which {problem}{shape}"
    if self.increasing and any(b <= a for a, b in zip(value, value[1:])):
      return f"must be strictly increasing{shape}"
    if self.unique and len(set(map(str, value))) != len(value):
      return f"names an item twice{shape}"
    return None


@dataclasses.dataclass(frozen=True)
class Rule(Check):
  """Anything else: a predicate and the words for what is valid."""
  test: Callable[[Any], bool]
  valid: str

  def __call__(self, value):
    try:
      ok = self.test(value)
    except (TypeError, ValueError, re.error):  # re.error: a bad pattern in a list of regexes
      ok = False
    return None if ok else f"must be {self.valid}"


def matches(pattern: str, valid: str) -> Rule:
  return Rule(lambda v: isinstance(v, str) and re.fullmatch(pattern, v) is not None, valid)
