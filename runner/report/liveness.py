"""Whether a run is still going: another process holds the flock that a vmoe process keeps on
<workdir>/.vmoe.lock while it works there (runner/workdirs/workdir_lock.py), which the kernel
drops when that process ends however it ends; `is_held` probes it without changing the file."""
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
