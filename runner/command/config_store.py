"""Registers the schemas and the catalog's model names in Hydra's ConfigStore (the CLI's business).

Composition checks every YAML file against these typed nodes: an unknown key or a value of the
wrong type fails there, with the valid keys or choices.
"""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from runner.config import sections
from runner.config.resolve import as_dict
from runner.config.schema import TASK_SCHEMAS
from runner.models import catalog
from runner.models.text import TEXT_SIZES


def register_model(name: str) -> None:
  """Adds a model name of the catalog grammar as an option of the `model` config group.

  As plain values, not a typed node: the same option then fills a task's full model config
  (pretrain) and the all-optional model overrides of eval, ensemble and few-shot (a released
  checkpoint names its model), each checked against its own schema.
  """
  ConfigStore.instance().store(group="model", name=name, node=as_dict(catalog.model_config(name)))


def _copies_share_the_store() -> None:
  """Hydra deep-copies its config repository at every composition (CachingConfigRepository), and
  with it the ConfigStore singleton that the repository's structured source holds: every schema
  and model option stored here, half the time of a composition (0.136 s -> 0.061 s per checked
  command on 2 CPU cores, 2026-11-27), and `--help` composes once per config group. Hydra's own
  fix (facebookresearch/hydra#2928) has the source read the live store instead of holding it;
  this does the same here: a copy of the singleton is the singleton. Composition never writes to
  the store through that copy, and `ConfigStore.load` deep-copies each node it returns."""
  ConfigStore.__deepcopy__ = lambda self, memo: self


_registered = False


def register_configs() -> None:
  """Gives Hydra the schemas and model names, once per process, after the built-ins and the
  plug-ins have registered (runner/builtins.py, runner/plugins.py)."""
  global _registered
  if _registered:
    return
  _registered = True
  sections.complete()  # every module has registered its keys: the schema is made, once
  _copies_share_the_store()
  store = ConfigStore.instance()
  for task, schema in TASK_SCHEMAS.items():
    store.store(name=f"{task}_schema", node=schema)
  for name in catalog.registered_names():
    register_model(name)
  for name, (width, depth, mlp_dim, num_heads) in TEXT_SIZES.items():  # text=<size>: the tower
    store.store(group="text", name=name, node=dict(name=name, width=width, depth=depth,
                                                   mlp_dim=mlp_dim, num_heads=num_heads))
