"""The config layer between Hydra and the library: typed schemas, their checks, their resolution.

It imports no library code above it and no Hydra (runner/command/config_store.py gives the
schemas to Hydra): the library receives typed objects or plain arguments, never the composed dict.
"""
from __future__ import annotations

import pathlib

from runner.config.validate import validate

# What `resolve` gives needs OmegaConf. Python runs this file before any module of the package,
# runner.config.schema included, which the models and the train step import; so these names are
# imported on first use, and the compute path runs where OmegaConf is not installed (a CUDA JAX
# image: benchmarks/gpu.py, tests/unit/test_compute_path_imports.py).
_RESOLVE_NAMES = ("as_dict", "from_dict", "load")


def __getattr__(name: str):
  if name not in _RESOLVE_NAMES:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  from runner.config import resolve  # OmegaConf: see _RESOLVE_NAMES
  value = getattr(resolve, name)
  globals()[name] = value
  return value


def conf_dir() -> pathlib.Path:
  """The `conf/` folder of this checkout (the package is installed in editable mode)."""
  return pathlib.Path(__file__).resolve().parents[2] / "conf"


__all__ = ["as_dict", "conf_dir", "from_dict", "load", "validate"]
