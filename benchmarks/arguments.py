"""Every benchmark's command line, checked before anything runs: a bad argument is refused in one
line on stderr, `<prog>: <flag> <value>: <what is valid>`, with exit status 2 and no traceback,
before JAX starts its backend or a file is written (as `vmoe` refuses a bad key)."""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import NoReturn


class Parser(argparse.ArgumentParser):
  """argparse, with its own refusals (an unknown option, a missing value) and the checks below
  said in one line each."""

  def error(self, message: str) -> NoReturn:
    self.refuse(f"{message} (--help lists the options)")

  def refuse(self, line: str) -> NoReturn:
    """A bad argument or the wrong machine: one line, exit status 2, nothing measured."""
    print(f"{self.prog}: {line}", file=sys.stderr, flush=True)
    raise SystemExit(2)

  def names(self, flag: str, text: str, noun: str, valid) -> tuple[str, ...]:
    """A comma-separated list of names from `valid`, duplicates dropped, at least one."""
    names = tuple(dict.fromkeys(name for name in text.split(",") if name))
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
      problem = f"no {noun} {', '.join(unknown)}" if unknown else f"no {noun} given"
      self.refuse(f"{flag} {text!r}: {problem}; valid: {', '.join(valid)}")
    return names

  def choice(self, flag: str, text: str, valid) -> str:
    if text not in valid:
      self.refuse(f"{flag} {text!r}: valid: {', '.join(valid)}")
    return text

  def number(self, flag: str, text, kind: type, low: float, high: float | None = None, *,
             low_open: bool = False):
    """An int or float in [low, high] ((low, high] if `low_open`; NaN refused)."""
    try:
      value = kind(text)
    except (TypeError, ValueError):
      value = None
    if value is None or not _within(value, low, high, low_open):
      noun = "an integer" if kind is int else "a number"
      self.refuse(f"{flag} {text!r}: valid: {noun} {_bound(low, high, low_open)}")
    return value

  def numbers(self, flag: str, text: str, kind: type, low: float,
              high: float | None = None, *, low_open: bool = False) -> tuple:
    """A comma-separated list of such numbers, at least one."""
    items = [item for item in str(text).split(",") if item.strip()]
    noun = "integers" if kind is int else "numbers"
    bound = _bound(low, high, low_open)
    if not items:
      self.refuse(f"{flag} {text!r}: valid: comma-separated {noun} {bound}")
    values = []
    for item in items:
      try:
        value = kind(item)
      except ValueError:
        value = None
      if value is None or not _within(value, low, high, low_open):
        self.refuse(f"{flag} {text!r}: {item.strip()!r} is not; valid: comma-separated {noun} "
                    f"{bound}")
      values.append(value)
    return tuple(values)

  def folder(self, flag: str, text: str, holding: str | None = None) -> pathlib.Path:
    """An existing folder (with the file `holding` in it, if given), resolved."""
    path = pathlib.Path(text).expanduser()
    problem = ("no such folder" if not path.is_dir() else
               f"no {holding} in it" if holding and not (path / holding).is_file() else None)
    if problem:
      valid = f"a folder holding {holding}" if holding else "an existing folder"
      self.refuse(f"{flag} {text!r}: {problem}; valid: {valid}")
    return path.resolve()


def _within(value, low: float, high: float | None, low_open: bool) -> bool:
  top = float("inf") if high is None else high
  return (low < value <= top) if low_open else (low <= value <= top)


def _bound(low: float, high: float | None, low_open: bool) -> str:
  if high is None:
    return f"> {low}" if low_open else f">= {low}"
  return f"from {low} (excluded) to {high}" if low_open else f"from {low} to {high}"
