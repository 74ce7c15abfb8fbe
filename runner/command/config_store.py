"""Registers the schemas and the catalog's model names for Hydra (the CLI's business).

Composition checks every YAML file against these typed nodes: an unknown key or a value of the
wrong type fails there, with the valid keys or choices. They are stored in `VmoeStore`, apart from
Hydra's ConfigStore, which Hydra deep-copies at every composition (with every schema and model
option: 0.314 s a composition against 0.189 s, in-process on the 2-core VM, 2026-11-28); vmoe's
config source (hydra_plugins/vmoe_configs) holds none: a composition copies only what it loads."""
from __future__ import annotations

import functools

from hydra.core.config_store import ConfigStore

from runner.config import sections
from runner.config.resolve import as_dict
from runner.config.subcommands import SUBCOMMANDS
from runner.models import catalog
from runner.models.text import TEXT_SIZES


class VmoeStore(ConfigStore):
  """A ConfigStore of vmoe's own: `VmoeStore()` is one instance per process (Hydra's Singleton,
  which a launcher's child process receives with Hydra's state, as it receives the ConfigStore)."""


def register_model(name: str) -> None:
  """Adds a model name of the catalog grammar as an option of the `model` config group, as plain
  values, not a typed node: the same option then fills a task's full model config (pretrain) and
  the all-optional model overrides of eval, ensemble and few-shot (a released checkpoint names its
  model), each checked against its own schema."""
  VmoeStore().store(group="model", name=name, node=as_dict(catalog.model_config(name)))


@functools.cache
def register_configs() -> None:
  """Gives Hydra the schemas and model names, once per process, after the built-ins and the
  plug-ins have registered (runner/builtins.py, runner/plugins.py)."""
  sections.build()  # every module has registered its keys: the schema is made, once
  store = VmoeStore()
  for task, subcommand in SUBCOMMANDS.items():
    if subcommand.is_stage:
      store.store(name=f"{task}_schema", node=subcommand.schema)
  for name in catalog.registered_names():
    register_model(name)
  for name, (width, depth, mlp_dim, num_heads) in TEXT_SIZES.items():  # text=<size>: the tower
    store.store(group="text", name=name, node=dict(name=name, width=width, depth=depth,
                                                   mlp_dim=mlp_dim, num_heads=num_heads))
