"""Research code in a user's own module: `plugins=[my_lab.hash_router,my_lab.metrics]` (see
docs/extending.md; also the `vmoe.plugins` entry points). Plug-ins load before a config is composed
(the schema needs their keys), in the checking process and again in every job."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
import traceback

from runner.errors import UserError

ENTRY_POINT_GROUP = "vmoe.plugins"
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")  # a dotted module name, as `import` takes it

_loaded: dict[str, object] = {}


class PluginError(UserError):
  """A plug-in module that cannot be found or fails while it is imported."""


def entry_point_modules() -> list[str]:
  """Modules that installed packages declare in the `vmoe.plugins` entry-point group."""
  return [ep.value.split(":")[0] for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]


def _where_it_failed(error: BaseException, module: str) -> str:
  """The innermost frame of the plug-in's own code, as `file:line`, for the error message."""
  if isinstance(error, SyntaxError) and error.filename:  # not compiled: no frame of its own ran
    return f" at {error.filename}:{error.lineno}"
  frames = traceback.extract_tb(error.__traceback__)
  top = module.split(".")[0]
  own = [f for f in frames if top in f.filename.replace(os.sep, ".")]
  frame = (own or frames or [None])[-1]
  return f" at {frame.filename}:{frame.lineno}" if frame else ""


def loaded() -> list[str]:
  """The plug-in modules this process has loaded, in order (a job started elsewhere loads them)."""
  return list(_loaded)


def load(names=(), *, entry_points: bool = True) -> list[str]:
  """Imports each named module once (the working directory is searched first, as `python -m`
  does) and the entry-point group's; returns the modules loaded, in order."""
  names = [str(n) for n in (names or [])]
  if bad := [n for n in names if not _MODULE.fullmatch(n)]:
    raise PluginError(
        f"plugins={names} names {', '.join(map(repr, bad))}, which is not a Python module name: "
        "give importable module names, e.g. plugins=[my_lab.hash_router] for my_lab/hash_router.py "
        "under the working directory.")
  if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.insert(0, os.getcwd())
  wanted = list(dict.fromkeys(names + (entry_point_modules() if entry_points else [])))
  for name in wanted:
    if name in _loaded:
      continue
    try:
      _loaded[name] = importlib.import_module(name)
    except ModuleNotFoundError as e:
      if e.name and (name == e.name or name.startswith(e.name + ".")):
        raise PluginError(
            f"plugins: no module named {name!r} (looked in the working directory {os.getcwd()} "
            "and the installed packages). A plug-in is a Python file or package importable by "
            "that name, e.g. my_lab/hash_router.py run from the folder holding my_lab/ as "
            "plugins=[my_lab.hash_router].") from None
      raise PluginError(f"plug-in module {name!r} failed to import: it needs the module "
                        f"{e.name!r}, which is not installed{_where_it_failed(e, name)}.") from None
    except UserError:
      raise
    except Exception as e:  # noqa: BLE001 (any error in a user's module is reported, not raised)
      raise PluginError(f"plug-in module {name!r} failed to import: {type(e).__name__}: {e}"
                        f"{_where_it_failed(e, name)}. Fix the module, or drop it from plugins=.")
  return wanted


def requested(overrides: list[str]) -> list[str]:
  """The modules a command line's `plugins=` override names (before Hydra composes it):
  `plugins=a`, `plugins=[a,b]`, `+plugins=[a]`; a sweep over plug-in lists loads them all."""
  names = []
  for override in overrides:
    key, eq, value = override.partition("=")
    if not eq or key.lstrip("+~") != "plugins":
      continue
    for item in re.split(r"[,\[\]\s]+", value):
      item = item.strip("'\"")
      if item and item != "null":
        names.append(item)
  return list(dict.fromkeys(names))
