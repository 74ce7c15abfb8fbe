"""A second vmoe process on a live run's workdir is refused; a killed run leaves no stale lock."""
from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from runner.errors import UserError
from runner.workdirs.workdir_lock import LOCK_FILE, WorkdirLock


def _hold_lock(workdir) -> subprocess.Popen:
  """Another process that takes the lock on workdir and sleeps; returns once it holds it."""
  code = textwrap.dedent(f"""
      import time
      from runner.workdirs.workdir_lock import WorkdirLock
      with WorkdirLock({str(workdir)!r}, "vmoe pretrain workdir=held"):
        time.sleep(120)
  """)
  repo = pathlib.Path(__file__).parents[2]
  holder = subprocess.Popen([sys.executable, "-c", code], cwd=repo)
  lock_file = workdir / LOCK_FILE
  deadline = time.monotonic() + 60
  while f"pid {holder.pid} " not in (lock_file.read_text() if lock_file.exists() else ""):
    assert holder.poll() is None, "the lock-holding process exited"
    assert time.monotonic() < deadline, "the lock-holding process never took the lock"
    time.sleep(0.05)
  return holder


def test_second_process_is_refused_until_the_holder_is_killed(tmp_path):
  workdir = tmp_path / "runs" / "up"
  holder = _hold_lock(workdir)
  try:
    with pytest.raises(UserError) as refused:
      with WorkdirLock(str(workdir), "vmoe pretrain workdir=second"):
        pytest.fail("a second lock on a live workdir was granted")
    message = str(refused.value)
    assert refused.value.exit_code == 2
    assert message.startswith(f"workdir {workdir} is in use by another vmoe process (pid "
                              f"{holder.pid} on host ")
    assert "vmoe pretrain workdir=held); wait for it to finish" in message
    assert "\n" not in message
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  with WorkdirLock(str(workdir), "vmoe pretrain workdir=third"):
    assert f"pid {os.getpid()} " in (workdir / LOCK_FILE).read_text()


def test_lock_file_names_the_holder(tmp_path):
  with WorkdirLock(str(tmp_path / "new" / "dir"), "vmoe eval init.checkpoint=runs/down"):
    text = (tmp_path / "new" / "dir" / LOCK_FILE).read_text()
  assert text.startswith(f"pid {os.getpid()} on host ")
  assert ", started 20" in text and text.endswith(": vmoe eval init.checkpoint=runs/down\n")


def test_nested_locks_on_different_workdirs_and_relock(tmp_path):
  with WorkdirLock(str(tmp_path / "a"), "vmoe pretrain"), \
       WorkdirLock(str(tmp_path / "b"), "vmoe finetune"):
    with pytest.raises(UserError, match="is in use by another vmoe process"):
      with WorkdirLock(str(tmp_path / "a"), "vmoe eval"):
        pass
  with WorkdirLock(str(tmp_path / "a"), "vmoe eval"):  # released on exit
    pass


def test_disabled_lock_does_nothing(tmp_path):
  with WorkdirLock(str(tmp_path / "a"), "vmoe pretrain"):
    with WorkdirLock(str(tmp_path / "a"), "vmoe pretrain", enabled=False):
      pass
  assert not (tmp_path / "b").exists()
  with WorkdirLock(str(tmp_path / "b"), "vmoe pretrain", enabled=False):
    pass
  assert not (tmp_path / "b").exists()


def test_filesystem_without_flock_runs_unlocked_with_a_warning(tmp_path, monkeypatch, capsys):
  def no_flock(*args):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
  monkeypatch.setattr(fcntl, "flock", no_flock)
  with WorkdirLock(str(tmp_path / "a"), "vmoe pretrain"):
    pass
  err = capsys.readouterr().err
  assert err.startswith(f"warning: cannot lock {tmp_path / 'a' / LOCK_FILE} (No locks available)")
  assert err.count("\n") == 1
