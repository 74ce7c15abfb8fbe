"""The config layer between Hydra and the library: typed schemas, their checks, their resolution.

`schema` declares every key (type, default, range), `relations` the rules between keys,
`validate` checks both once before compute, `resolve` turns a composed config into the typed
object a task runs. `registries` holds the names a config may choose (router families,
evaluators, optimizers, schedules), filled by the modules that define them, and `sections` the
keys those modules declare, added to the schema; `mesh` and `preprocessing` the pure rules of
meshes and preprocessing specs that the checks need. This layer imports no library code above
it and no Hydra (runner/config_store.py gives the schemas to Hydra); the library receives typed
objects or plain arguments, never the composed dict.
"""
from __future__ import annotations

import pathlib

from runner.config.resolve import as_dict, from_dict, load
from runner.config.validate import validate


def conf_dir() -> pathlib.Path:
  """The `conf/` folder of this checkout (the package is installed in editable mode)."""
  return pathlib.Path(__file__).resolve().parents[2] / "conf"


__all__ = ["as_dict", "conf_dir", "from_dict", "load", "validate"]
