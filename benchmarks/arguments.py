"""Every benchmark's command line, checked before anything runs: a bad argument is refused in one
line on stderr, `<prog>: <flag> <value>: <what is valid>`, with exit status 2 and no traceback,
before JAX starts its backend or a file is written (as `vmoe` refuses a bad key)."""
from __future__ import annotations

import argparse
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

  def number(self, flag: str, text, kind: type, low: float, high: float | None = None):
    """An int or float in [low, high] (NaN refused)."""
    try:
      value = kind(text)
    except (TypeError, ValueError):
      value = None
    if value is None or not low <= value <= (float("inf") if high is None else high):
      noun = "an integer" if kind is int else "a number"
      bound = f">= {low}" if high is None else f"from {low} to {high}"
      self.refuse(f"{flag} {text!r}: valid: {noun} {bound}")
    return value

  def numbers(self, flag: str, text: str, kind: type, low: float,
              high: float | None = None) -> tuple:
    """A comma-separated list of such numbers, at least one."""
    items = [item for item in str(text).split(",") if item.strip()]
    noun = "integers" if kind is int else "numbers"
    bound = f">= {low}" if high is None else f"from {low} to {high}"
    if not items:
      self.refuse(f"{flag} {text!r}: valid: comma-separated {noun} {bound}")
    values = []
    for item in items:
      try:
        value = kind(item)
      except ValueError:
        value = None
      if value is None or not low <= value <= (float("inf") if high is None else high):
        self.refuse(f"{flag} {text!r}: {item.strip()!r} is not; valid: comma-separated {noun} "
                    f"{bound}")
      values.append(value)
    return tuple(values)
