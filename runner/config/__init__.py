"""The config layer between Hydra and the library: schemas, model catalog registration, validation.

Only this package and `runner.cli` / `runner.tasks` know about Hydra; the library below takes plain
dicts and arguments.
"""
from __future__ import annotations

import pathlib

from hydra.core.config_store import ConfigStore

from runner.config.schema import (TASK_SCHEMAS, ModelConfig, MoeConfig, RouterConfig)
from runner.models import catalog


def conf_dir() -> pathlib.Path:
  """The `conf/` folder of this checkout (the package is installed in editable mode)."""
  return pathlib.Path(__file__).resolve().parents[2] / "conf"


def register_model(name: str) -> None:
  """Adds a model name of the catalog grammar as an option of the `model` config group."""
  cfg = catalog.model_config(name)
  node = ModelConfig(**{k: v for k, v in cfg.items() if k not in ("moe", "router")},
                     moe=MoeConfig(**cfg["moe"]), router=RouterConfig(**cfg["router"]))
  ConfigStore.instance().store(group="model", name=name, node=node)


def register_configs() -> None:
  store = ConfigStore.instance()
  for task, schema in TASK_SCHEMAS.items():
    store.store(name=f"{task}_schema", node=schema)
  for name in catalog.CPU_MODELS + catalog.PAPER_MODELS:
    register_model(name)


register_configs()
