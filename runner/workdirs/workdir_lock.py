"""One live vmoe process per workdir (an exclusive flock on <workdir>/.vmoe.lock): two would corrupt
each other's checkpoints and metrics. The kernel drops a flock when its holder dies, even by
SIGKILL, so a crash never leaves it locked; the file's text (the holder) only serves the error."""
from __future__ import annotations

import datetime
import fcntl
import os
import pathlib
import socket
import sys

from runner.errors import UserError

LOCK_FILE = ".vmoe.lock"


class WorkdirLock:
  """`with WorkdirLock(workdir, command):` holds the workdir, or raises UserError if it is in use;
  `enabled=False` (every process but process 0 of a multi-host job) makes it do nothing."""

  def __init__(self, workdir: str, command: str, enabled: bool = True):
    self.workdir = pathlib.Path(workdir)
    self.command = command
    self.enabled = enabled
    self.file = None

  def __enter__(self) -> WorkdirLock:
    if not self.enabled:
      return self
    self.workdir.mkdir(parents=True, exist_ok=True)
    path = self.workdir / LOCK_FILE
    # The file is never truncated before the lock is ours (it names the live holder) and never
    # deleted: a process that opened it just before the unlink would lock the deleted file while
    # the next one creates and locks a new file, and both would run.
    file = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    try:
      fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = file.read().strip() or "it has not written its details yet"
      file.close()
      raise UserError(
          f"workdir {self.workdir} is in use by another vmoe process ({holder}); wait for it to "
          f"finish, stop it, or choose another workdir=<dir>.") from None
    except OSError as e:  # a filesystem without flock (some NFS or Lustre mounts)
      file.close()
      print(f"warning: cannot lock {path} ({e.strerror}); nothing stops a second vmoe process "
            f"from using workdir {self.workdir} at the same time.", file=sys.stderr)
      return self
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    file.truncate(0)
    file.write(f"pid {os.getpid()} on host {socket.gethostname()}, started {started}: "
               f"{self.command}\n")
    file.flush()
    self.file = file
    return self

  def __exit__(self, *exc) -> None:
    if self.file is not None:
      self.file.close()  # closing the last descriptor of the file releases the lock
      self.file = None


def is_held(workdir: str | os.PathLike) -> bool:
  """True while some process (this one too) holds the workdir's lock, probed shared and non-blocking
  (WorkdirLock would rewrite the holder's record). A process starting then would find it in use."""
  try:
    fd = os.open(pathlib.Path(workdir) / LOCK_FILE, os.O_RDONLY)
  except OSError:
    return False  # never locked
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # closing fd (finally) lets go of it
    return False
  except BlockingIOError:
    return True
  except OSError:  # a filesystem without flock: no lock to tell a live run by
    return False
  finally:
    os.close(fd)
