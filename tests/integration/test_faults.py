"""Faults a real run meets, each survived with nothing lost: divergence, a second process on the
same workdir, a checkpoint that cannot be saved, a W&B server that cannot be reached."""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import QUIET, TINY_MODEL

pytestmark = pytest.mark.xdist_group("faults")

FAST = [*TINY_MODEL, *QUIET, "data.batch_size=16", "eval.every_steps=0"]


def _steps(workdir) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit())


def test_divergence_stops_at_once_and_keeps_the_last_good_checkpoint(run_cli, tmp_path):
  # No clipping and a huge peak learning rate: the loss is NaN within the warmup.
  code, _, err = run_cli("pretrain", f"workdir={tmp_path}", *FAST, "train.steps=60",
                         "checkpoint.every_steps=5", "optim.lr=1e3", "optim.grad_clip_norm=null",
                         "schedule.warmup_steps=30", "train.log_every_steps=1")
  assert code == 1, err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  for text in ("training diverged at step", "is nan", "the last good checkpoint, step 5",
               "optim.lr (now 1000)", "optim.grad_clip_norm=1.0 (now off)"):
    assert text in err, (text, err)
  diverged_at = int(err.split("diverged at step ")[1].split(":")[0])
  assert _steps(tmp_path) == [5] and diverged_at > 5  # nothing saved from a non-finite state
  from runner.checkpoints import checkpoint
  params, _, step = checkpoint.load_params(str(tmp_path))
  assert step == 5
  assert all(np.isfinite(np.asarray(x)).all() for x in __import__("jax").tree.leaves(params))
  assert not (tmp_path / "summary.json").exists()


def test_a_second_process_on_a_live_workdir_is_refused(run_cli, tmp_path):
  args = ["pretrain", f"workdir={tmp_path}", *FAST, "train.steps=100000",
          "checkpoint.every_steps=5"]
  proc = subprocess.Popen([sys.executable, "-m", "runner.cli", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=dict(os.environ))
  try:
    deadline = time.time() + 240
    while not _steps(tmp_path):
      assert proc.poll() is None, proc.stderr.read()
      assert time.time() < deadline, "no checkpoint within the timeout"
      time.sleep(0.1)
    code, _, err = run_cli(*args)
    assert code == 2, err
    assert f"is in use by another vmoe process (pid {proc.pid}" in err and "Traceback" not in err
    assert proc.poll() is None  # the live run is untouched
  finally:
    proc.kill()
    proc.wait()
  # A killed run leaves no stuck lock: the same workdir resumes (here: just its final evaluation).
  last = _steps(tmp_path)[-1]
  code, _, err = run_cli("pretrain", f"workdir={tmp_path}", *FAST, f"train.steps={last}",
                         "schedule.warmup_steps=0")
  assert code == 0, err


def test_a_checkpoint_that_cannot_be_saved_stops_the_run(run_cli, tmp_path, monkeypatch):
  original, calls = ocp.CheckpointManager.save, []

  def disk_full_on_the_second_save(self, step, *args, **kwargs):
    calls.append(step)
    if len(calls) == 2:
      raise OSError(errno.ENOSPC, "No space left on device")
    return original(self, step, *args, **kwargs)
  monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full_on_the_second_save)
  code, _, err = run_cli("pretrain", f"workdir={tmp_path}", *FAST, "train.steps=20",
                         "schedule.warmup_steps=0",
                         "checkpoint.every_steps=5")
  assert code == 1, err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  for text in ("could not save the checkpoint of step 10", "No space left on device",
               "Free some disk space", "step 5", "is kept"):
    assert text in err, (text, err)
  assert _steps(tmp_path) == [5]
  monkeypatch.undo()
  from runner.checkpoints import checkpoint
  assert checkpoint.load_params(str(tmp_path))[2] == 5
  assert not (tmp_path / "summary.json").exists()


def test_wandb_online_without_a_server_falls_back_to_offline(run_cli, tmp_path, monkeypatch,
                                                              request):
  with socket.socket() as s:  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  monkeypatch.delenv("WANDB_MODE", raising=False)
  monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
  monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
  import wandb

  from runner.logging import wandb_run
  probes, starts = [], []  # each passed on to the real one
  probe, init = wandb_run._unreachable, wandb.init
  monkeypatch.setattr(wandb_run, "_unreachable", lambda url: probes.append(url) or probe(url))
  monkeypatch.setattr(wandb, "init", lambda *a, **kw: starts.append(kw["mode"]) or init(*a, **kw))
  # The key is set: W&B's login must say so whatever an earlier test of this process did to W&B's
  # process-wide settings (in a full suite's worker it may have cached "no key").
  monkeypatch.setattr(wandb, "login", lambda *a, **kw: True)
  # W&B reads WANDB_BASE_URL once per process, at its first setup: an earlier test of this worker
  # may have set it up with the default server. Start W&B afresh, here and for the tests after.
  wandb.teardown()
  request.addfinalizer(wandb.teardown)
  code, _, err = run_cli("pretrain", f"workdir={tmp_path}", *TINY_MODEL, "train.steps=2",
                         "schedule.warmup_steps=0",
                         "data.batch_size=16", "logger.progress=false", "logger.wandb.mode=online")
  assert code == 0, err
  warnings = [line for line in err.splitlines() if "warning" in line.lower()]
  assert len(warnings) == 1 and "logging offline" in warnings[0], err
  assert list((tmp_path / "wandb").glob("offline-run-*"))
  assert (tmp_path / "summary.json").exists()
  # The run did not wait on the dead server: one probe (refused at once), then W&B offline, with
  # no online start (which would wait out its deadline); the report's pictures then resume that
  # offline run without probing again (runner/report/wandb_media.py).
  assert probes == [f"http://127.0.0.1:{port}"] and starts == ["offline", "offline"]
