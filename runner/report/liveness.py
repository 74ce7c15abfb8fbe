"""Whether a run is still going: another process holds its workdir lock.

runner/workdir_lock.py takes an exclusive flock on <workdir>/.vmoe.lock for as long as a vmoe
process works there, and the kernel drops it when that process ends however it ends. Asking
with WorkdirLock itself would rewrite the file's record of the holder (which the page shows), so
this probes the same lock shared and non-blocking and lets go at once; the file is not changed.
A vmoe process starting in that microsecond would find the workdir in use and say so.
"""
from __future__ import annotations

import fcntl
import os
import pathlib
import socket

from runner.report import workdir
from runner.workdir_lock import LOCK_FILE


def held_by_another_process(path: str | pathlib.Path) -> bool:
  """True while a process other than this one holds the workdir's lock."""
  path = pathlib.Path(path)
  try:
    fd = os.open(path / LOCK_FILE, os.O_RDONLY)
  except OSError:
    return False  # never locked
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except BlockingIOError:
    held = True
  except OSError:  # a filesystem without flock: no lock to tell a live run by
    return False
  else:
    held = False
    fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)
  if not held:
    return False
  holder = workdir.read_holder(path)
  # This process's own lock (a stage writing its page before it lets go) is not another run.
  return not (holder and holder.pid == os.getpid() and holder.host == socket.gethostname())
