"""A run refused for bad input leaves no folder behind. Hydra creates the workdir (`.hydra/`, the
job's log) before a stage opens its data and checkpoints, so a refused stage would leave a folder
that could pass for a run. A workdir holding only Hydra's record when the stage started was made by
this command: a refusal removes it, and the empty folders above it that the command created."""
from __future__ import annotations

import pathlib
import shutil

HYDRA_RECORD = ".hydra"


def nearest_existing(path: str | pathlib.Path) -> pathlib.Path:
  """The deepest folder of `path` (itself or an ancestor) that exists now."""
  path = pathlib.Path(path).absolute()
  while not path.exists() and path != path.parent:
    path = path.parent
  return path


def is_new(workdir: str | pathlib.Path, job_name: str) -> bool:
  """Whether the workdir holds nothing but Hydra's record of this command."""
  try:
    names = {p.name for p in pathlib.Path(workdir).iterdir()}
  except OSError:
    return False
  return names <= {HYDRA_RECORD, f"{job_name}.log"}


def remove(workdir: str | pathlib.Path, existed: pathlib.Path | None) -> None:
  """Removes what the command wrote: the workdir, and its empty parents below `existed` (the
  deepest folder of its path that existed before the command; None: not known, so only the
  workdir's contents). A workdir that existed before (an empty workdir=) is emptied, not removed."""
  workdir = pathlib.Path(workdir).absolute()
  if existed is None or existed == workdir:
    for entry in workdir.iterdir():
      if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
      else:
        entry.unlink(missing_ok=True)
    return
  shutil.rmtree(workdir, ignore_errors=True)
  parent = workdir.parent
  while parent != existed and existed in parent.parents:
    try:
      parent.rmdir()  # only when empty
    except OSError:
      return
    parent = parent.parent
