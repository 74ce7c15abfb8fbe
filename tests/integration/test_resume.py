"""A crash, kill, signal or damaged checkpoint loses at most the steps since the last good
checkpoint; rerunning the same command resumes to exactly the parameters of an uninterrupted run."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import QUIET, TINY_MODEL

# One worker trains the module's uninterrupted run, once.
pytestmark = pytest.mark.xdist_group("resume")

ARGS = ["pretrain", *TINY_MODEL, *QUIET, "train.steps=40", "schedule.warmup_steps=0",
        "checkpoint.every_steps=10",
        "train.log_every_steps=10", "eval.every_steps=0", "data.batch_size=16",
        # Random augmentation: the resumed data stream must replay the same crops and flips.
        'data.pp_train="decode(3)|resize(20)|random_crop(16)|flip_lr|value_range(-1,1)"']


# The run signals itself from inside, at a known step: when the loop asks whether step
# `signal_at` is a checkpoint step (once per step, after training it), every save started so far
# is committed first, then each signal in `signals` is sent; os.kill runs the Python handler
# before it returns. Where the signal lands depends on nothing but the step.
_SIGNALLED_RUN = """
import os, sys
from runner.command import allocator
allocator.pause_collector()  # as `vmoe` starts
from runner import cli
from runner.checkpoints import checkpoint
signal_at, signals = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
should_save = checkpoint.Checkpointer.should_save

def should_save_then_signal(self, step):
  if step == signal_at and signals:
    self.wait()
    while signals:
      os.kill(os.getpid(), signals.pop(0))
  return should_save(self, step)

checkpoint.Checkpointer.should_save = should_save_then_signal
sys.exit(cli.main(sys.argv[3:]))
"""
SIGNAL_AT = 13  # between the checkpoints of steps 10 and 20


def _signalled_run(workdir, *signals: int) -> tuple[int, str]:
  """(exit code, stderr) of the run that signals itself after step SIGNAL_AT."""
  proc = subprocess.run([sys.executable, "-c", _SIGNALLED_RUN, str(SIGNAL_AT),
                         ",".join(str(int(s)) for s in signals), *ARGS, f"workdir={workdir}"],
                        capture_output=True, text=True, env=dict(os.environ), timeout=600)
  return proc.returncode, proc.stderr


def _steps(workdir) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit())


def _logged_steps(workdir) -> list[int]:
  return [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _final_params(workdir):
  from runner.checkpoints import checkpoint
  params, _, step = checkpoint.load_params(str(workdir))
  assert step == 40
  return params


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> pathlib.Path:
  """The run never interrupted (read, never written: a test that damages it takes a copy)."""
  from runner import cli
  workdir = tmp_path_factory.mktemp("straight")
  assert cli.main([*ARGS, f"workdir={workdir}"]) == 0
  return workdir


@pytest.fixture(scope="module")
def uninterrupted(straight_run):
  return _final_params(straight_run)


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_interrupted_run_resumes_to_identical_parameters(how, uninterrupted, tmp_path, run_cli):
  sig = signal.SIGKILL if how == "sigkill" else signal.SIGTERM
  code, err = _signalled_run(tmp_path, sig)
  if how == "sigkill":
    assert code == -signal.SIGKILL
    assert _steps(tmp_path) == [10]  # steps 11-13 are lost; the committed step 10 is intact
  else:  # graceful: finish the step, save, explain, exit 128 + SIGTERM
    assert code == 128 + signal.SIGTERM, err
    assert "Rerun the same command to resume" in err and "Traceback" not in err
    assert f"stopped by SIGTERM after step {SIGNAL_AT}" in err
    assert _steps(tmp_path) == [10, SIGNAL_AT]  # nothing lost: the signalled step is saved
  steps = _steps(tmp_path)
  assert steps and steps[-1] < 40, "the run finished before it was interrupted"

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
  code, err = _signalled_run(tmp_path, signal.SIGTERM, signal.SIGTERM)
  assert code == 128 + signal.SIGTERM, err
  assert "Traceback" not in err
  assert "second signal" in err or "Rerun the same command" in err
  # At once: the second signal ends the process inside the step that the first asked to finish,
  # before its checkpoint, its log or any later step.
  assert "second signal (SIGTERM): exiting now without saving" in err
  assert "stopped by SIGTERM" not in err
  assert _steps(tmp_path) == [10] and _logged_steps(tmp_path) == [10]

  code, _, err = run_cli(*ARGS, f"workdir={tmp_path}")
  assert code == 0, err
  _same_parameters(uninterrupted, _final_params(tmp_path))


def _damage(step_dir: pathlib.Path) -> None:
  """Random bytes over every array file of the step's parameters."""
  files = [p for p in (step_dir / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files
  for path in files:
    path.write_bytes(os.urandom(path.stat().st_size or 64))


def test_unreadable_latest_checkpoint_falls_back_to_the_previous_one(straight_run, uninterrupted,
                                                                     tmp_path, run_cli):
  # The same command's finished run, copied (training it again here would give the same files).
  shutil.copytree(straight_run, tmp_path, dirs_exist_ok=True)
  assert _steps(tmp_path) == [30, 40]
  _damage(tmp_path / "checkpoints" / "40")

  code, _, err = run_cli(*ARGS, f"workdir={tmp_path}")
  assert code == 0, err
  assert "checkpoint step 40 cannot be read" in err and "resumes from step 30" in err
  assert (tmp_path / "unreadable_checkpoints" / "40").is_dir()  # kept for a look, not deleted
  _same_parameters(uninterrupted, _final_params(tmp_path))
