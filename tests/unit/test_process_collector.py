"""Python's cycle collector in a `vmoe` process (runner/command/allocator.py): paused at the entry
while the libraries import, then, as the job starts, what exists is frozen out of its scans and it
resumes, once; a process that calls the CLI in-process keeps its collector as it was."""
from __future__ import annotations

import gc
import subprocess
import sys

from conftest import QUIET, TINY_MODEL
from runner.command import allocator

_PAUSED_AT_ENTRY = """
import gc
from runner.command import allocator
allocator.pause_collector()
assert not gc.isenabled()
made_at_import = [[i] for i in range(5000)]
allocator.resume_collector()
frozen = gc.get_freeze_count()
assert gc.isenabled() and frozen >= 5000, frozen
assert gc.get_threshold() == allocator.COLLECTOR_THRESHOLDS, gc.get_threshold()
allocator.resume_collector()  # a second job of the process (an in-process sweep): nothing more
assert gc.get_freeze_count() == frozen
cycle = []
cycle.append(cycle)
del cycle
assert gc.collect() >= 1  # the collector runs on what was made after the freeze
"""

_NEVER_PAUSED = """
import gc
from runner.command import allocator
gc.set_threshold(700, 10, 10)
allocator.resume_collector()
assert gc.isenabled() and gc.get_freeze_count() == 0 and gc.get_threshold() == (700, 10, 10)
"""


def _python(code: str) -> None:
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]


def test_paused_at_the_entry_resumes_once_with_the_imports_frozen():
  _python(_PAUSED_AT_ENTRY)


def test_a_process_that_never_paused_it_keeps_its_collector():
  _python(_NEVER_PAUSED)


def test_the_job_starts_its_task_with_the_collector_resumed(run_cli, monkeypatch, tmp_path):
  """The stage's task runs with the collector on: `vmoe`'s job resumes it before the task."""
  from runner import tasks
  seen = {}

  def task(sub, typed, checkpoints, devices_checked):
    seen.update(sub=sub, enabled=gc.isenabled(), paused=allocator._collector_paused)
    return 0.0
  monkeypatch.setattr(tasks, "run_task", task)
  monkeypatch.setattr(allocator, "_collector_paused", True)
  thresholds = gc.get_threshold()
  gc.disable()  # as pause_collector() leaves it at the entry
  try:
    code, _, err = run_cli("pretrain", f"workdir={tmp_path / 'run'}", *TINY_MODEL, *QUIET)
  finally:
    gc.enable()
    gc.set_threshold(*thresholds)
  assert code == 0, err
  assert seen == {"sub": "pretrain", "enabled": True, "paused": False}
