"""The one door to checkpoints: Orbax `CheckpointManager` under `<workdir>/checkpoints`.

Each step directory holds four items: `params`, `opt_state` (the train state, restorable onto any
mesh), `meta` (step and the data-iterator position) and `config` (the resolved config of the
run, so later stages know the model and data). Stages find checkpoints from a workdir, its
`checkpoints/` folder or one step folder.
"""
from __future__ import annotations

import os
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from runner.errors import UserError

ITEMS = ("params", "opt_state", "meta", "config")


class CheckpointError(UserError):
  """A checkpoint path that does not exist, holds no checkpoint, or does not fit the model."""


def _handlers():
  return {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
          "meta": ocp.JsonCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}


def locate(path: str) -> tuple[pathlib.Path, int]:
  """(manager directory, step) for a workdir, its checkpoints/ folder, or a step folder."""
  p = pathlib.Path(path).expanduser()
  if not p.exists():
    raise CheckpointError(f"init.checkpoint={path!r} does not exist; give the workdir of an "
                          "earlier stage (e.g. runs/up), its checkpoints/ folder, or one step folder "
                          "inside it.")
  for candidate, step in ((p / "checkpoints", None), (p, None), (p.parent, p.name)):
    if not candidate.is_dir():
      continue
    steps = sorted(int(d.name) for d in candidate.iterdir()
                   if d.is_dir() and d.name.isdigit() and (d / "params").exists())
    if step is not None:
      if step.isdigit() and int(step) in steps:
        return candidate, int(step)
      continue
    if steps:
      return candidate, steps[-1]
  raise CheckpointError(f"no checkpoint found under {path!r}: expected <workdir>/checkpoints/<step>/"
                        "params as written by `vmoe pretrain` or `vmoe finetune`.")


class Checkpointer:
  """Saves every `every_steps` (and when forced), keeps the last `keep`, asynchronously."""

  def __init__(self, directory: str | os.PathLike, keep: int = 2, every_steps: int = 0,
               async_save: bool = True):
    self.every_steps = every_steps
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=options,
                                         item_handlers=_handlers())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int) -> bool:
    return bool(self.every_steps) and step % self.every_steps == 0

  def save(self, step: int, params, opt_state, meta: dict, config: dict) -> None:
    if step in self.manager.all_steps():
      return
    self.manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta), config=ocp.args.JsonSave(config)))

  def restore(self, step: int, abstract_params, abstract_opt_state):
    """(params, opt_state, meta); the abstract trees carry the target shardings."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params),
        opt_state=ocp.args.StandardRestore(abstract_opt_state),
        meta=ocp.args.JsonRestore()))
    return restored["params"], restored["opt_state"], dict(restored["meta"])

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _reader(directory: pathlib.Path) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(directory.absolute(), item_handlers=_handlers(),
                               options=ocp.CheckpointManagerOptions(create=False))


def read_config(path: str) -> dict:
  """The resolved config stored with the checkpoint at `path`."""
  directory, step = locate(path)
  manager = _reader(directory)
  return dict(manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])


def param_shapes(path: str) -> dict:
  """The tree of parameter shapes stored at `path`, read from metadata only."""
  directory, step = locate(path)
  metadata = _reader(directory).item_metadata(step)["params"]
  tree = getattr(metadata, "tree", metadata)  # Orbax wraps the tree in a metadata object
  return jax.tree.map(lambda m: tuple(m.shape), dict(tree))


def load_params(path: str) -> tuple[dict, dict, int]:
  """(parameters as host NumPy arrays, stored config, step) for initialising a later stage."""
  directory, step = locate(path)
  manager = _reader(directory)
  # Whatever mesh saved it (8 devices, 2 hosts...), read it whole onto this process's first device.
  metadata = manager.item_metadata(step)["params"]
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        dict(getattr(metadata, "tree", metadata)))
  restored = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(target), config=ocp.args.JsonRestore()))
  params = jax.tree.map(np.asarray, restored["params"])
  return params, dict(restored["config"]), step
