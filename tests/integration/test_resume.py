"""A crash, kill, signal or damaged checkpoint loses at most the steps since the last good
checkpoint; rerunning the same command resumes to exactly the parameters of an uninterrupted run."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import QUIET, TINY_MODEL

ARGS = ["pretrain", *TINY_MODEL, *QUIET, "train.steps=40", "schedule.warmup_steps=0",
        "checkpoint.every_steps=10",
        "train.log_every_steps=10", "eval.every_steps=0", "data.batch_size=16",
        # Random augmentation: the resumed data stream must replay the same crops and flips.
        'data.pp_train="decode(3)|resize(20)|random_crop(16)|flip_lr|value_range(-1,1)"']


def _start(workdir):
  return subprocess.Popen([sys.executable, "-m", "runner.cli", *ARGS, f"workdir={workdir}"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ))


def _wait_for_checkpoint(proc, workdir, timeout=240):
  """Returns the first committed checkpoint step (Orbax renames the folder on commit)."""
  start = time.time()
  while time.time() - start < timeout:
    steps = [int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()]
    if steps:
      return min(steps)
    if proc.poll() is not None:
      pytest.fail(f"run ended before a checkpoint appeared: {proc.stderr.read()}")
    time.sleep(0.02)
  proc.kill()
  pytest.fail("no checkpoint within the timeout")


def _final_params(workdir):
  from runner import checkpoint
  params, _, step = checkpoint.load_params(str(workdir))
  assert step == 40
  return params


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  from runner import cli
  workdir = tmp_path_factory.mktemp("straight")
  assert cli.main([*ARGS, f"workdir={workdir}"]) == 0
  return _final_params(workdir)


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_interrupted_run_resumes_to_identical_parameters(how, uninterrupted, tmp_path, run_cli):
  proc = _start(tmp_path)
  first = _wait_for_checkpoint(proc, tmp_path)
  proc.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  if how == "sigkill":
    assert proc.returncode == -signal.SIGKILL
  else:  # graceful: finish the step, save, explain, exit 128 + SIGTERM
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Rerun the same command to resume" in err and "Traceback" not in err
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").glob("*") if p.name.isdigit())
  assert steps and steps[-1] < 40, "the run finished before it was interrupted"
  assert first in steps or steps[0] > first

  code, _, err = run_cli(*ARGS, f"workdir={tmp_path}")
  assert code == 0, err
  resumed = _final_params(tmp_path)
  for (path, a), b in zip(_leaves(uninterrupted), [x for _, x in _leaves(resumed)]):
    np.testing.assert_array_equal(a, b, err_msg=path)


def _leaves(tree):
  import jax
  return [(jax.tree_util.keystr(p), np.asarray(v))
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _same_parameters(a, b):
  for (path, x), (_, y) in zip(_leaves(a), _leaves(b)):
    np.testing.assert_array_equal(x, y, err_msg=path)


def test_a_second_signal_exits_at_once_and_the_rerun_resumes(uninterrupted, tmp_path, run_cli):
  proc = _start(tmp_path)
  _wait_for_checkpoint(proc, tmp_path)
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  start = time.time()
  _, err = proc.communicate(timeout=60)
  assert time.time() - start < 30
  assert proc.returncode == 128 + signal.SIGTERM, err
  assert "Traceback" not in err
  assert "second signal" in err or "Rerun the same command" in err  # the first may have won

  code, _, err = run_cli(*ARGS, f"workdir={tmp_path}")
  assert code == 0, err
  _same_parameters(uninterrupted, _final_params(tmp_path))


def _damage(step_dir: pathlib.Path) -> None:
  """Random bytes over every array file of the step's parameters."""
  files = [p for p in (step_dir / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files
  for path in files:
    path.write_bytes(os.urandom(path.stat().st_size or 64))


def test_unreadable_latest_checkpoint_falls_back_to_the_previous_one(uninterrupted, tmp_path,
                                                                     run_cli):
  code, _, err = run_cli(*ARGS, f"workdir={tmp_path}")
  assert code == 0, err
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").glob("*") if p.name.isdigit())
  assert steps == [30, 40]
  _damage(tmp_path / "checkpoints" / "40")

  code, _, err = run_cli(*ARGS, f"workdir={tmp_path}")
  assert code == 0, err
  assert "checkpoint step 40 cannot be read" in err and "resumes from step 30" in err
  assert (tmp_path / "unreadable_checkpoints" / "40").is_dir()  # kept for a look, not deleted
  _same_parameters(uninterrupted, _final_params(tmp_path))
