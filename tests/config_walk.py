"""The walk of a run's config from a subcommand's task to its train step, as rooms (the layers of
pyproject.toml's import contract) and the times it climbs back up.

Every call of a function of the runner package that is given the run config or a section of it
(an instance of a schema dataclass of runner/config, as an argument) is recorded (the dataclasses'
own methods, construction and comparison, are not), from the task's `run` until the train step is made
(`make_train_step`, where the walk ends: the step is built and compiled from there). The rooms of
those calls, in order, are the walk; a climb is a call in a higher room than the call before it:
the config went down to a lower room, came back up, and is handed down again from above."""
from __future__ import annotations

import dataclasses
import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _Reached(Exception):
  """Raised where the walk ends, to stop the run before it compiles anything."""


def layers() -> dict[str, int]:
  """Room -> its floor (0: the top) from the layers contract."""
  config = tomllib.loads((ROOT / "pyproject.toml").read_text())
  contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers")
  return {room.strip(): floor for floor, layer in enumerate(contract["layers"])
          for room in layer.split("|")}


@dataclasses.dataclass
class Walk:
  calls: list[tuple[str, str]]  # (room, module.function) in call order

  @property
  def rooms(self) -> list[str]:
    out = []
    for room, _ in self.calls:
      if not out or out[-1] != room:
        out.append(room)
    return out

  @property
  def climbs(self) -> int:
    floors = layers()
    rooms = self.rooms
    return sum(floors[b] < floors[a] for a, b in zip(rooms, rooms[1:]))

  def describe(self) -> str:
    return " -> ".join(f"{room}({function})" for room, function in self.calls)


def _is_config(value) -> bool:
  """The run config or one of its sections (typed by runner/config's schema)."""
  return (dataclasses.is_dataclass(value) and not isinstance(value, type)
          and type(value).__module__.startswith("runner.config"))


def walk(task_run, config, *args) -> Walk:
  """Runs `task_run(config, *args)`, recording the config's walk, until the train step is made:
  the caller makes runner.train.loop's `make_train_step` raise `_Reached` (the run stops there)."""
  calls = []

  def profile(frame, event, arg):
    if event != "call":
      return
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("runner."):
      return
    code = frame.f_code
    if code.co_name.startswith("__"):  # a dataclass's own __init__, __eq__
      return
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    if any(_is_config(frame.f_locals.get(name)) for name in names):
      calls.append((module.split(".")[1], f"{module.split('.', 2)[-1]}.{code.co_name}"))

  sys.setprofile(profile)
  try:
    task_run(config, *args)
  except _Reached:
    pass
  finally:
    sys.setprofile(None)
  return Walk(calls)
