"""runner.checkpoints.weights.open: a checkpoint path's kind decided once, from real files (a run's Orbax
checkpoints written by runner.checkpoints.checkpoint, a big_vision `.npz` and a google-research/vmoe checkpoint
written as the tests' formats write them), and the opened value answering without deciding again.
"""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from formats import vmoe_writer  # tests/ is on sys.path (conftest rootdir)
from formats.reference_tree import Dims, reference_tree

from runner.checkpoints import checkpoint, vmoe_format, weights
from runner.checkpoints.checkpoint import CheckpointError

DIMS = Dims(hidden=8, layers=1, mlp=16, heads=2, patch=4, image=8, classes=3)
CONFIG = {"model": {"name": "vit_tiny"}, "stage": "pretrain"}


def _params(step: int) -> dict:
  return {"head": {"kernel": jnp.full((2, 3), float(step)), "bias": jnp.zeros((3,))}}


def _save(workdir, steps) -> None:
  saver = checkpoint.Checkpointer(workdir / "checkpoints", keep=5, async_save=False)
  for step in steps:
    saver.save(step, _params(step), {"count": jnp.asarray(step)}, meta={"step": step},
               config=dict(CONFIG, seed=step))
  saver.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("open")
  _save(root / "run", (1, 2))
  np.savez(root / "vit.npz", **{f"params/{k}": v for k, v in
                                reference_tree("big_vision", dims=DIMS).items()})
  vmoe_writer.write(str(root / "vmoe"), reference_tree("vmoe", moe_layers=(0,), dims=DIMS))
  return root


@pytest.fixture
def decisions(monkeypatch):
  """How many times the kind of a path is decided (runner.checkpoints.weights.open, and below it the tests
  of the released formats' files and of our step folders) from now on."""
  counts = {"open": 0, "released": 0, "locate": 0}

  def counting(name, function):
    def counted(*args, **kwargs):
      counts[name] += 1
      return function(*args, **kwargs)
    return counted
  monkeypatch.setattr(weights, "open", counting("open", weights.open))
  monkeypatch.setattr(vmoe_format, "is_vmoe_checkpoint",
                      counting("released", vmoe_format.is_vmoe_checkpoint))
  monkeypatch.setattr(checkpoint, "locate", counting("locate", checkpoint.locate))
  return counts


def test_a_run_is_opened_from_its_workdir_checkpoints_folder_or_step_folder(files):
  run = files / "run"
  for path, step in ((run, 2), (run / "checkpoints", 2), (run / "checkpoints" / "1", 1)):
    opened = weights.open(str(path))
    assert (opened.kind, opened.released) == (weights.RUN, False), path
    assert (opened.directory, opened.step, opened.run_folder) == (run / "checkpoints", step, run)
    assert opened.path == str(path)


def test_released_checkpoints_are_opened_by_their_files(files):
  npz = weights.open(str(files / "vit.npz"))
  assert (npz.kind, npz.released, npz.run_folder) == (weights.NPZ, True, None)
  for path in (files / "vmoe", files / "vmoe.index"):  # the prefix, or its index file
    opened = weights.open(str(path))
    assert (opened.kind, opened.released, opened.run_folder) == (weights.VMOE, True, None)
    assert (opened.directory, opened.step) == (None, None)


def test_a_path_holding_no_checkpoint_fails_as_locate_says(files, tmp_path):
  (tmp_path / "empty").mkdir()
  for path in (files / "missing", files / "missing.npz", tmp_path / "empty"):
    with pytest.raises(CheckpointError) as opened:
      weights.open(str(path))
    with pytest.raises(CheckpointError) as located:
      checkpoint.locate(str(path))
    assert str(opened.value) == str(located.value)


def test_an_opened_run_answers_without_deciding_again(files, decisions):
  opened = weights.open(str(files / "run"))
  assert decisions == {"open": 1, "released": 1, "locate": 1}
  params, stored, step = opened.load()
  assert step == 2 and stored == dict(CONFIG, seed=2) == opened.stored_config()
  np.testing.assert_array_equal(params["head"]["kernel"], np.full((2, 3), 2.0))
  assert "did not finish" in opened.unfinished()  # no summary.json
  assert opened.run_folder == files / "run"
  assert decisions == {"open": 1, "released": 1, "locate": 1}


def test_an_opened_release_answers_without_deciding_again(files, decisions):
  for name, kind in (("vit.npz", weights.NPZ), ("vmoe", weights.VMOE)):
    opened = weights.open(str(files / name))
    params, stored, step = opened.load()
    assert (stored, step) == ({}, 0) and params["embedding_kernel"].shape == (4, 4, 3, 8)
    assert opened.stored_config() is None and opened.unfinished() is None
    assert opened.describe().startswith(f"a {kind} (")
    assert "hidden size 8, num layers 1, mlp dim 16" in opened.describe()
  assert decisions == {"open": 2, "released": 2, "locate": 0}


def test_an_opened_run_keeps_the_step_it_named(tmp_path):
  """A workdir opened before a newer step is saved still gives the step it was opened at (its
  config and parameters agree); opening it again takes the newer one."""
  _save(tmp_path, (1,))
  opened = weights.open(str(tmp_path))
  _save(tmp_path, (2,))
  params, stored, step = opened.load()
  assert (step, stored["seed"]) == (1, 1)
  np.testing.assert_array_equal(params["head"]["kernel"], np.full((2, 3), 1.0))
  assert weights.open(str(tmp_path)).step == 2


def test_unfinished_takes_a_finished_run_a_named_step_and_a_release(files, tmp_path):
  _save(tmp_path, (1,))
  assert "did not finish" in weights.open(str(tmp_path)).unfinished()
  assert weights.open(str(tmp_path / "checkpoints" / "1")).unfinished() is None
  (tmp_path / "summary.json").write_text(json.dumps({"val/prec@1": 0.5}))
  assert weights.open(str(tmp_path)).unfinished() is None
  assert weights.open(str(files / "vit.npz")).unfinished() is None


def test_a_command_opens_each_path_once(files, decisions):
  """Checkpoints (what runner.config reads through) opens a path at its first question; a path
  holding no checkpoint fails with its one message each time it is asked for."""
  checkpoints = weights.Checkpoints()
  run, npz, missing = str(files / "run"), str(files / "vit.npz"), str(files / "missing")
  assert checkpoints.stored_config(run) == dict(CONFIG, seed=2)
  assert checkpoints.unfinished(run) and checkpoints.open(run).step == 2
  assert checkpoints.stored_config(npz) is None
  assert checkpoints.describe(npz) == weights.open(npz).describe()
  messages = set()
  for _ in range(3):
    with pytest.raises(CheckpointError) as e:
      checkpoints.stored_config(missing)
    messages.add(str(e.value))
  assert len(messages) == 1 and "does not exist" in messages.pop()
  assert decisions["open"] == 4  # run, npz, missing, and the describe above
