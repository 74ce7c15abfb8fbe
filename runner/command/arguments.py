"""A command line's overrides and flags, as Hydra reads them, and a sweep's jobs from them: pure
text, nothing is composed here (runner/command/compose.py does that)."""
from __future__ import annotations

import itertools
import math

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep


# Hydra flags that take a value, and flags that mean "don't run, just show something".
_VALUE_FLAGS = {"-cd", "--config-dir", "-cn", "--config-name", "-cp", "--config-path", "-c",
                "--cfg", "-p", "--package", "--experimental-rerun", "--info"}
_SHOW_FLAGS = {"-h", "--help", "--hydra-help", "--version", "-i", "--info", "--shell-completion",
               "-sc"}


def split_args(args: list[str]) -> tuple[dict, list[str], bool]:
  """(flags with values, overrides, whether Hydra only shows help/info)."""
  flags, overrides, show, i = {}, [], False, 0
  while i < len(args):
    arg = args[i]
    name, eq, value = arg.partition("=")
    if arg in _SHOW_FLAGS or name in _SHOW_FLAGS:
      show = True
    if name in _VALUE_FLAGS and name.startswith("-"):
      if not eq and i + 1 < len(args):
        value, i = args[i + 1], i + 1
      flags[name] = value
    elif not arg.startswith("-"):
      overrides.append(arg)
    i += 1
  return flags, overrides, show


# Validating each job of a sweep before any runs costs one composition each; beyond this many
# jobs, a covering set of jobs is checked up front, which holds every value of each swept key at
# least once (every job is checked anyway when it starts).
MAX_CHECKED_JOBS = 64


def sweep_axes(overrides: list[str], study: dict) -> tuple[list[str], list[list[str]]]:
  """(fixed overrides, one list of `key=value` per swept key), hydra.* dropped. `study` holds a
  sweep study's own `hydra.sweeper.params`; the command line wins over it."""
  parser = OverridesParser.create()
  fixed, axes, given = [], [], set()
  for ov in parser.parse_overrides(overrides):
    if ov.key_or_group.startswith("hydra"):
      continue
    given.add(ov.key_or_group)
    if ov.is_sweep_override():
      axes.append([f"{ov.get_key_element()}={v}" for v in _sweep_values(ov)])
    else:
      fixed.append(ov.input_line)
  for key, values in study.items():
    if key not in given:
      ov = parser.parse_overrides([f"{key}={values}"])[0]
      axes.append([f"{key}={v}" for v in ov.sweep_string_iterator()]
                  if ov.is_sweep_override() else [ov.input_line])
  return fixed, axes


class SearchRangeError(ValueError):
  pass


def _sweep_values(override) -> list:
  """The values of a sweep override; of a search range (optuna's interval(a,b)): its ends, a < b."""
  sweep = override.value()
  if isinstance(sweep, IntervalSweep):
    if not sweep.start < sweep.end:
      raise SearchRangeError(
          f"the search range {override.input_line} is empty: interval(a, b) needs a < b (e.g. "
          f"'{override.get_key_element()}=tag(log,interval(1e-4,1e-1))').")
    return [sweep.start, sweep.end]
  return list(override.sweep_string_iterator())


def job_count(overrides: list[str], study: dict) -> int:
  return math.prod(len(axis) for axis in sweep_axes(overrides, study)[1])


def jobs(overrides: list[str], study: dict) -> list[list[str]]:
  """The overrides of the jobs to check before the sweep runs: every job (just one without a
  sweep), or beyond MAX_CHECKED_JOBS, jobs of the sweep that take every value of each swept key:
  job i takes value i mod n of each key of n values (as many jobs as the longest key has values)."""
  fixed, axes = sweep_axes(overrides, study)
  jobs = itertools.islice(itertools.product(*axes), MAX_CHECKED_JOBS + 1)
  combos = [fixed + list(c) for c in jobs]
  if len(combos) <= MAX_CHECKED_JOBS:
    return combos
  return [fixed + [axis[i % len(axis)] for axis in axes]
          for i in range(max(len(axis) for axis in axes))]


def overrides_first(args: list[str]) -> list[str]:
  """The arguments with every override before the first flag: Hydra's argument parser takes
  overrides only before its flags (`seed=1 --multirun`, not `--multirun seed=1 --cfg job x=1`)."""
  flags, overrides, i = [], [], 0
  while i < len(args):
    arg = args[i]
    if arg.startswith("-"):
      flags.append(arg)
      if arg in _VALUE_FLAGS and i + 1 < len(args) and not (
          arg in ("--info", "-i") and "=" in args[i + 1]):  # --info takes an optional value
        flags.append(args[i + 1])
        i += 1
    else:
      overrides.append(arg)
    i += 1
  return overrides + flags


# Hydra's flags that choose a command's mode (at most one is valid), as each's long form.
_MODE_FLAGS = {"-m": "--multirun", "--multirun": "--multirun", "-c": "--cfg", "--cfg": "--cfg",
               "-i": "--info", "--info": "--info", "-sc": "--shell-completion",
               "--shell-completion": "--shell-completion"}


def modes(args: list[str]) -> set[str]:
  return {_MODE_FLAGS[a.partition("=")[0]] for a in args if a.partition("=")[0] in _MODE_FLAGS}


def multirun(args: list[str]) -> bool:
  return "--multirun" in modes(args)
