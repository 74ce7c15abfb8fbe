"""The one door to checkpoints: Orbax `CheckpointManager` under `<workdir>/checkpoints`, a step
holding `params`, `opt_state`, `meta` (step, data position) and `config` (for later stages).
Checkpoints get damaged (a full disk, a killed copy, a flaky file system): every read names the
failing step and item in a `CheckpointError`, a resumed run skips unreadable newer steps (moving
them aside), and a failed save, even in the background, stops the run (`CheckpointSaveError`),
keeping the older checkpoints."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import logging
import os
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from runner.errors import CheckpointError, RunError

ITEMS = ("params", "opt_state", "meta", "config")
# Orbax 0.12 writes this last, just before it renames `<step>.orbax-checkpoint-tmp` to `<step>`
# (on local disks the rename is its commit; on GCS the marker is).
COMMIT_MARKER = "commit_success.txt"
STEP_METADATA = "_CHECKPOINT_METADATA"  # written first, when the save starts
UNREADABLE = "unreadable_checkpoints"  # next to checkpoints/: steps a resumed run could not read


class CheckpointSaveError(RunError):
  """A checkpoint could not be written: the run stops, the older checkpoints stay."""


@dataclasses.dataclass
class Restored:
  """What `Checkpointer.restore_latest` found; `skipped`: (step, reason) of newer unreadable steps,
  now under `moved_to`."""
  step: int
  params: Any
  opt_state: Any
  meta: dict
  skipped: list[tuple[int, str]]
  moved_to: pathlib.Path | None = None


def _handlers():
  return {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
          "meta": ocp.JsonCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}


@contextlib.contextmanager
def _quiet():
  """Orbax (absl) and asyncio log every failed read at ERROR; our one error says it instead."""
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
  levels = [logger.level for logger in loggers]
  for logger in loggers:
    logger.setLevel(logging.CRITICAL)
  try:
    yield
  except BaseException:
    gc.collect()  # asyncio reports the failed read's orphaned futures when they are collected
    raise
  finally:
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)


def _reason(e: BaseException) -> str:
  """'Type: first line' of the innermost cause (Orbax wraps TensorStore's useful message)."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = (str(e).strip().splitlines() or [""])[0]
  text = text if len(text) <= 300 else text[:297] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _step_dirs(directory: pathlib.Path) -> dict[int, pathlib.Path]:
  """Every step folder by step: digit names (`<step>.orbax-checkpoint-tmp` are unfinished saves)."""
  if not directory.is_dir():
    return {}
  return {int(d.name): d for d in directory.iterdir() if d.name.isdigit() and d.is_dir()}


def _looks_like_step(d: pathlib.Path) -> bool:
  """An Orbax step folder, even a damaged one (not, say, a numbered --multirun job folder)."""
  return any((d / name).exists() for name in (*ITEMS, STEP_METADATA, COMMIT_MARKER))


def _incomplete(d: pathlib.Path) -> str | None:
  """Why step folder `d` is not a whole save (an item or the commit marker missing), or None."""
  if missing := [item for item in ITEMS if not (d / item).is_dir()]:
    return f"{', '.join(missing)} missing"
  if not (d / COMMIT_MARKER).is_file():
    return f"no {COMMIT_MARKER}"
  return None


def _advice(directory: pathlib.Path, step: int, which: str = "an earlier") -> str:
  """Where to turn instead of a bad step: the newest complete earlier one."""
  earlier = [s for s, d in _step_dirs(directory).items() if s < step and _incomplete(d) is None]
  if earlier:
    return (f"pass {which} step folder ({directory / str(max(earlier))}) or rerun the stage "
            "that wrote it.")
  return f"there is no complete earlier step in {directory}; rerun the stage that wrote it."


@contextlib.contextmanager
def _reading(directory: pathlib.Path, step: int, item: str):
  """Any failure while reading `item` of `step` becomes a CheckpointError naming them."""
  try:
    with _quiet():
      yield
  except CheckpointError:
    raise
  except Exception as e:  # Orbax and TensorStore raise anything, UnicodeDecodeError to Exception
    reason = f"{item} is corrupted ({_reason(e)})"
    raise CheckpointError(
        f"checkpoint {directory / str(step)} cannot be read: {reason}. It may have been partially "
        f"written or damaged; {_advice(directory, step)}", reason=reason) from e


def _restore_item(manager, directory: pathlib.Path, step: int, item: str, args):
  """One item at a time, so that a failure names the item."""
  with _reading(directory, step, item):
    return manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]


def _metadata_tree(manager, directory: pathlib.Path, step: int, item: str = "params") -> dict:
  """The stored tree of array metadata (shape, dtype) of the parameters, or of `item`."""
  with _reading(directory, step, item):
    metadata = manager.item_metadata(step)[item]
    tree = getattr(metadata, "tree", metadata)  # Orbax wraps the tree in a metadata object
    if tree is None:
      raise ValueError(f"no array metadata ({item}/_METADATA missing or unreadable)")
    return dict(tree) if item == "params" else tree  # an optimizer's state may be a list


def _leaf_shapes(tree) -> set:
  """(path, shape) of every array, a path's dict keys, indices and attribute names alike: Orbax
  stores an optimizer's named tuples as dicts."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {(tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path),
           tuple(leaf.shape)) for path, leaf in leaves}


def _mismatch(stored: dict, abstract) -> str | None:
  """How the stored parameter shapes differ from the model's (a few of them), or None."""
  def shapes(tree):
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in leaves}
  got, want = shapes(stored), shapes(abstract)
  diffs = ([f"{k} missing" for k in want if k not in got]
           + [f"{k} not in the model" for k in got if k not in want]
           + [f"{k} stored {got[k]}, model {want[k]}" for k in want
              if k in got and got[k] != want[k]])
  if not diffs:
    return None
  return ", ".join(diffs[:3]) + (f" and {len(diffs) - 3} more" if len(diffs) > 3 else "")


def locate(path: str) -> tuple[pathlib.Path, int]:
  """(manager directory, step) of a workdir, its checkpoints/ folder or a step folder. A partial
  newest step is an error, not a fallback: the user says which step a later stage starts from."""
  p = pathlib.Path(path).expanduser()
  if not p.exists():
    raise CheckpointError(f"init.checkpoint={path!r} does not exist; give the workdir of an "
                          "earlier stage (e.g. runs/up), its checkpoints/ folder, or one step "
                          "folder inside it.")
  for directory, name in ((p / "checkpoints", None), (p, None), (p.parent, p.name)):
    steps = {s: d for s, d in _step_dirs(directory).items() if _looks_like_step(d)}
    if name is None and steps:
      step = max(steps)
    elif name is not None and name.isdigit() and int(name) in steps:
      step = int(name)
    else:
      continue
    if problem := _incomplete(steps[step]):
      raise CheckpointError(
          f"checkpoint {steps[step]} is partial ({problem}): it may be a save that was interrupted "
          f"or a copy that did not finish; {_advice(directory, step, 'the previous')}")
    return directory, step
  raise CheckpointError(f"no checkpoint found under {path!r}: expected <workdir>/checkpoints/"
                        "<step>/ with params, opt_state, meta and config, as written by `vmoe "
                        "pretrain` or `vmoe finetune`.")


def has_checkpoints(workdir: str | os.PathLike) -> bool:
  """Whether `<workdir>/checkpoints` holds steps: a rerun resumes (or fails), never starts over."""
  return bool(_step_dirs(pathlib.Path(workdir) / "checkpoints"))


class Checkpointer:
  """Saves every `every_steps` (and when forced), keeps the last `keep`, asynchronously."""

  def __init__(self, directory: str | os.PathLike, keep: int = 2, every_steps: int = 0,
               async_save: bool = True):
    self.directory = pathlib.Path(directory).absolute()
    self.every_steps = every_steps
    self.async_save = async_save
    self._pending = None  # the step whose asynchronous save is not yet known to have succeeded
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    try:
      self.manager = ocp.CheckpointManager(self.directory, options=options,
                                           item_handlers=_handlers())
    except Exception as e:
      raise self._save_error(None, e) from e

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int) -> bool:
    return bool(self.every_steps) and step % self.every_steps == 0

  def save(self, step: int, params, opt_state, meta: dict, config: dict) -> None:
    """Starts saving `step` (in the background if async); CheckpointSaveError if it fails."""
    self.wait()  # an earlier asynchronous save that failed is reported under its own step
    if step in self.manager.all_steps():
      return
    try:
      saved = self.manager.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
          meta=ocp.args.JsonSave(meta), config=ocp.args.JsonSave(config)))
    except Exception as e:
      raise self._save_error(step, e) from e
    self._pending = step if saved else None
    if not self.async_save:
      self.wait()

  def restore(self, step: int, abstract_params, abstract_opt_state):
    """(params, opt_state, meta); the abstract trees carry the target shardings."""
    d, m = self.directory, self.manager
    params = _restore_item(m, d, step, "params", ocp.args.StandardRestore(abstract_params))
    opt_state = _restore_item(m, d, step, "opt_state", ocp.args.StandardRestore(abstract_opt_state))
    return params, opt_state, dict(_restore_item(m, d, step, "meta", ocp.args.JsonRestore()))

  def restore_latest(self, abstract_params, abstract_opt_state) -> Restored | None:
    """The newest step that reads whole, or None in a fresh directory. Newer unreadable steps move
    to `<workdir>/unreadable_checkpoints/` (Orbax would list them, and refuse to save their step
    again); if no step reads, this raises and moves nothing: a run never starts over checkpoints."""
    skipped = []
    for step in sorted(_step_dirs(self.directory), reverse=True):
      try:
        params, opt_state, meta = self._read_step(step, abstract_params, abstract_opt_state)
      except CheckpointError as e:
        if e.reason is None:  # readable, but not this model's: falling back would not help
          raise
        skipped.append((step, e.reason))
        continue
      moved_to = self._move_aside([s for s, _ in skipped]) if skipped else None
      return Restored(step, params, opt_state, meta, skipped, moved_to)
    if not skipped:
      return None
    listing = "; ".join(f"step {s}: {reason}" for s, reason in skipped)
    raise CheckpointError(
        f"no checkpoint in {self.directory} can be read ({listing}), and a run does not start from "
        "scratch over a workdir with checkpoints: to start afresh, move that folder aside "
        f"(mv {self.directory} {self.directory}.old) and rerun.")

  def _read_step(self, step: int, abstract_params, abstract_opt_state):
    """(params, opt_state, meta) of a whole step, else a CheckpointError with a `reason`."""
    d = self.directory
    if problem := _incomplete(d / str(step)):
      raise CheckpointError(f"checkpoint {d / str(step)} is partial ({problem})",
                            reason=f"partial ({problem})")
    if mismatch := _mismatch(_metadata_tree(self.manager, d, step), abstract_params):
      raise CheckpointError(
          f"checkpoint {d / str(step)} does not fit this model ({mismatch}): rerun with the model "
          "and model.* overrides of the run that wrote it, or use a new workdir.")
    stored = _metadata_tree(self.manager, d, step, "opt_state")
    if _leaf_shapes(stored) != _leaf_shapes(abstract_opt_state):
      raise CheckpointError(
          f"checkpoint {d / str(step)} holds the state of another optimizer than this run's: "
          "rerun with the optim= and optim.* overrides of the run that wrote it (its config.yaml "
          "says them), or use a new workdir.")
    params, opt_state, meta = self.restore(step, abstract_params, abstract_opt_state)
    with _reading(d, step, "config"):  # later stages need it
      dict(_restore_item(self.manager, d, step, "config", ocp.args.JsonRestore()))
    return params, opt_state, meta

  def _move_aside(self, steps: list[int]) -> pathlib.Path:
    """Moves step folders to `<workdir>/unreadable_checkpoints/<step>` (a fresh name if taken)."""
    target_dir = self.directory.parent / UNREADABLE
    if jax.process_index() == 0:
      for step in steps:
        source, target = self.directory / str(step), target_dir / str(step)
        n = 1
        while target.exists():
          target, n = target_dir / f"{step}.{n}", n + 1
        try:
          target_dir.mkdir(parents=True, exist_ok=True)
          source.rename(target)
        except OSError as e:
          raise CheckpointError(f"cannot move the unreadable checkpoint {source} to {target} "
                                f"({_reason(e)}); move it out of {self.directory} by hand and "
                                "rerun.") from e
    if jax.process_count() > 1:
      ocp.multihost.sync_global_processes("vmoe_move_unreadable_checkpoints")
    self.manager.reload()  # Orbax caches the step list
    return target_dir

  def wait(self) -> None:
    """Blocks until the last save is on disk; raises CheckpointSaveError if it failed."""
    step, self._pending = self._pending, None
    try:
      with _quiet():  # Orbax logs the failure with its traceback; our error says it
        self.manager.wait_until_finished()  # re-raises what the background save raised, once
    except Exception as e:
      raise self._save_error(step, e) from e
    if step is not None:  # some failures Orbax only logs: check the step was committed
      if problem := _incomplete(self.directory / str(step)):
        raise self._save_error(step, RuntimeError(f"the step folder is partial ({problem})"))

  def close(self) -> None:
    """Waits for the last save (raising if it failed) and stops Orbax's threads."""
    try:
      self.wait()
    finally:
      try:
        self.manager.close()  # after a failed wait() Orbax does not raise the same error again
      except Exception as e:
        raise self._save_error(None, e) from e

  def _save_error(self, step: int | None, e: BaseException) -> CheckpointSaveError:
    """The step, the directory, the reason, and what is kept."""
    with contextlib.suppress(Exception):
      self.manager.reload()  # after a failed save Orbax forgets the older steps it still has
    what = (f"could not save the checkpoint of step {step}" if step is not None
            else "could not write checkpoints")
    root = e
    while root.__cause__ is not None:
      root = root.__cause__
    hint = ""
    if isinstance(root, OSError) and root.errno in (errno.ENOSPC, errno.EDQUOT):
      hint = " Free some disk space first."
    elif isinstance(root, OSError) and root.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
      hint = f" Make {self.directory} writable first."
    if good := [s for s, d in _step_dirs(self.directory).items()
                if s != step and _incomplete(d) is None]:
      kept = (f"The last good checkpoint, step {max(good)} ({self.directory / str(max(good))}), is "
              "kept; rerunning the same command resumes from it.")
    else:
      kept = "No earlier checkpoint was saved; rerunning the same command starts the run again."
    return CheckpointSaveError(f"{what} in {self.directory} ({_reason(e)}).{hint} {kept}")


def _reader(directory: pathlib.Path) -> ocp.CheckpointManager:
  with _quiet():
    return ocp.CheckpointManager(directory.absolute(), item_handlers=_handlers(),
                                 options=ocp.CheckpointManagerOptions(create=False))


def read_config(path: str, located: tuple[pathlib.Path, int] | None = None) -> dict:
  """The resolved config stored at `path` (`located`: what `locate(path)` gave, if known)."""
  directory, step = located or locate(path)
  with _reading(directory, step, "config"):
    return dict(_restore_item(_reader(directory), directory, step, "config",
                              ocp.args.JsonRestore()))


def param_shapes(path: str) -> dict:
  """The tree of parameter shapes stored at `path`, read from metadata only."""
  directory, step = locate(path)
  tree = _metadata_tree(_reader(directory), directory, step)
  with _reading(directory, step, "params"):
    return jax.tree.map(lambda m: tuple(m.shape), tree)


def load_params(path: str, located: tuple[pathlib.Path, int] | None = None, *,
                with_config: bool = True) -> tuple[dict, dict | None, int]:
  """(parameters as host NumPy arrays, stored config, step) for initialising a later stage;
  without the config (None) when the caller has it already (`located`: as for read_config)."""
  directory, step = located or locate(path)
  manager = _reader(directory)
  # Whatever mesh saved it (8 devices, 2 hosts...), read it whole onto this process's first device.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  with _reading(directory, step, "params"):
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                          _metadata_tree(manager, directory, step))
    params = jax.tree.map(np.asarray, _restore_item(manager, directory, step, "params",
                                                    ocp.args.StandardRestore(target)))
  if not with_config:
    return params, None, step
  with _reading(directory, step, "config"):
    config = dict(_restore_item(manager, directory, step, "config", ocp.args.JsonRestore()))
  return params, config, step
