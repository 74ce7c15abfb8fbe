"""Whether a run is still going: another process holds its workdir lock.

runner/workdirs/workdir_lock.py takes an exclusive flock on <workdir>/.vmoe.lock for as long as a vmoe
process works there, and the kernel drops it when that process ends however it ends; `is_held`
probes it without changing the file.
"""
from __future__ import annotations

import os
import pathlib
import socket

from runner.report import workdir
from runner.workdirs.workdir_lock import is_held


def held_by_another_process(path: str | pathlib.Path) -> bool:
  """True while a process other than this one holds the workdir's lock."""
  if not is_held(path):
    return False
  holder = workdir.read_holder(pathlib.Path(path))
  # This process's own lock (a stage writing its page before it lets go) is not another run.
  return not (holder and holder.pid == os.getpid() and holder.host == socket.gethostname())
