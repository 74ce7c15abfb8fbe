"""Damaged and unwritable checkpoints: one CheckpointError / CheckpointSaveError, never a traceback.

A module-scoped run writes steps 10, 20 and 30 with `Checkpointer` once; each test copies it and
damages the copy the way disks and killed copies do (random bytes, truncation, a missing item or
commit marker).
"""
from __future__ import annotations

import errno
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from runner.checkpoints.checkpoint import (CheckpointError, Checkpointer, CheckpointSaveError, has_checkpoints,
                               load_params, locate, param_shapes, read_config)
from runner.errors import RunError, UserError

# A failed TensorStore read leaves coroutines that Python reports as "unraisable" when collected
# (the CLI drops them with sys.unraisablehook); they are not what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

STEPS = (10, 20, 30)


def _params(step):
  rng = np.random.default_rng(step)
  return {"layer": {"kernel": jnp.asarray(rng.normal(size=(32, 64)), jnp.float32),
                    "bias": jnp.full((64,), float(step), jnp.float32)},
          "head": {"kernel": jnp.asarray(rng.normal(size=(64, 10)), jnp.bfloat16)}}


def _opt_state(step):
  return {"mu": jax.tree.map(lambda p: p * 0.5, _params(step)), "count": jnp.asarray(step)}


def _meta(step):
  return {"step": step, "position": 16 * step}


def _save(ckpt, step, params=None):
  ckpt.save(step, params or _params(step), _opt_state(step), meta=_meta(step),
            config={"seed": step, "model": {"name": "vit_tiny"}})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("pristine")
  ckpt = Checkpointer(workdir / "checkpoints", keep=3)
  for step in STEPS:
    _save(ckpt, step)
  ckpt.close()
  return workdir


@pytest.fixture
def run(pristine, tmp_path):
  """A fresh copy of the three-step workdir, to damage."""
  return pathlib.Path(shutil.copytree(pristine, tmp_path / "run"))


def _damage(step_dir: pathlib.Path, pattern: str, how: str) -> None:
  paths = sorted(step_dir.glob(pattern))
  assert paths, f"nothing matches {pattern} in {step_dir}"
  rng = np.random.default_rng(0)
  for path in paths:
    if how == "garbage":
      path.write_bytes(rng.bytes(max(64, path.stat().st_size)))
    elif how == "truncate":
      path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    elif how == "delete":
      shutil.rmtree(path) if path.is_dir() else path.unlink()


def _abstract():
  return jax.eval_shape(lambda: _params(0)), jax.eval_shape(lambda: _opt_state(0))


def _assert_tree_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _steps_on_disk(directory: pathlib.Path):
  return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


READERS = {"read_config": read_config, "param_shapes": param_shapes, "load_params": load_params}

# (file(s) under step 30, damage, item named, readers that read it: they fail, the others work)
CORRUPTIONS = [
    ("params/_METADATA", "garbage", "params", {"param_shapes", "load_params"}),
    ("params/_METADATA", "delete", "params", {"param_shapes", "load_params"}),
    ("config/metadata", "garbage", "config", {"read_config", "load_params"}),
    ("config/metadata", "truncate", "config", {"read_config", "load_params"}),
    ("params/ocdbt.process_0/d/*", "garbage", "params", {"load_params"}),
    ("params/ocdbt.process_0/d/*", "truncate", "params", {"load_params"}),
    ("params/manifest.ocdbt", "garbage", "params", {"param_shapes", "load_params"}),
    ("params/_sharding", "truncate", "params", {"param_shapes", "load_params"}),
    ("params/array_metadatas/process_0", "garbage", "params", {"load_params"}),
]


@pytest.mark.parametrize("pattern,how,item,failing", CORRUPTIONS,
                         ids=[f"{c[1]}-{c[0]}" for c in CORRUPTIONS])
def test_corrupted_newest_step_names_path_step_and_item(run, pattern, how, item, failing, caplog):
  ckpts = run / "checkpoints"
  _damage(ckpts / "30", pattern, how)
  for name, reader in READERS.items():
    if name not in failing:
      reader(str(run))  # the items it reads are intact
      continue
    with pytest.raises(CheckpointError) as e:
      reader(str(run))
    message = str(e.value)
    assert f"checkpoint {ckpts / '30'} cannot be read: {item} is corrupted (" in message, message
    assert f"pass an earlier step folder ({ckpts / '20'})" in message
    assert "\n" not in message and len(message) < 1000
  # Orbax's ERROR logs of the failed reads are silenced: the error says it once.
  assert not [r for r in caplog.records if r.name in ("absl", "asyncio")]
  # The earlier step, passed explicitly, still loads.
  params, config, step = load_params(str(ckpts / "20"))
  assert step == 20 and config["seed"] == 20
  _assert_tree_equal(params, _params(20))


@pytest.mark.parametrize("pattern,missing", [("params", "params missing"),
                                             ("opt_state", "opt_state missing"),
                                             ("commit_success.txt", "no commit_success.txt")])
def test_partial_newest_step_is_an_error_not_a_silent_fallback(run, pattern, missing):
  ckpts = run / "checkpoints"
  _damage(ckpts / "30", pattern, "delete")
  for path in (run, ckpts, ckpts / "30"):
    for reader in READERS.values():
      with pytest.raises(CheckpointError) as e:
        reader(str(path))
      message = str(e.value)
      assert f"checkpoint {ckpts / '30'} is partial ({missing})" in message, message
      assert f"pass the previous step folder ({ckpts / '20'})" in message
  assert locate(str(ckpts / "20")) == (ckpts, 20)


def test_partial_only_step_says_there_is_no_earlier_one(run):
  ckpts = run / "checkpoints"
  for step in (10, 20):
    shutil.rmtree(ckpts / str(step))
  _damage(ckpts / "30", "meta", "delete")
  with pytest.raises(CheckpointError, match="partial \\(meta missing\\).*no complete earlier step"):
    locate(str(run))


def test_a_folder_without_checkpoints_says_what_was_expected(tmp_path):
  (tmp_path / "notes.txt").write_text("not a run")
  (tmp_path / "7").mkdir()  # a numbered folder that is no Orbax step (e.g. a --multirun job)
  with pytest.raises(CheckpointError) as e:
    load_params(str(tmp_path))
  assert str(tmp_path) in str(e.value) and "expected <workdir>/checkpoints/<step>/" in str(e.value)
  assert isinstance(e.value, UserError)
  assert not has_checkpoints(tmp_path)


def test_orbax_tmp_folders_are_not_steps(run):
  ckpts = run / "checkpoints"
  shutil.copytree(ckpts / "30", ckpts / "40.orbax-checkpoint-tmp")
  _damage(ckpts / "40.orbax-checkpoint-tmp", "commit_success.txt", "delete")
  assert locate(str(run)) == (ckpts, 30)
  ckpt = Checkpointer(ckpts, keep=3)
  try:
    restored = ckpt.restore_latest(*_abstract())
  finally:
    ckpt.close()
  assert restored.step == 30 and restored.skipped == [] and restored.moved_to is None
  assert (ckpts / "40.orbax-checkpoint-tmp").is_dir()


def test_restore_latest_of_a_fresh_directory_is_none(tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints", keep=2)
  try:
    assert ckpt.restore_latest(*_abstract()) is None
  finally:
    ckpt.close()


def test_restore_latest_falls_back_past_a_corrupted_step_and_saves_it_again(run):
  ckpts = run / "checkpoints"
  _damage(ckpts / "30", "params/ocdbt.process_0/d/*", "garbage")
  ckpt = Checkpointer(ckpts, keep=3)
  try:
    restored = ckpt.restore_latest(*_abstract())
    assert restored.step == 20 and restored.meta == _meta(20)
    _assert_tree_equal(restored.params, _params(20))
    _assert_tree_equal(restored.opt_state, _opt_state(20))
    [(step, reason)] = restored.skipped
    assert step == 30 and reason.startswith("params is corrupted (")
    # The bad step left checkpoints/, so Orbax forgets it and training can write step 30 again.
    assert restored.moved_to == run / "unreadable_checkpoints"
    assert _steps_on_disk(run / "unreadable_checkpoints") == ["30"]
    assert _steps_on_disk(ckpts) == ["10", "20"]
    assert ckpt.latest_step() == 20 and list(ckpt.manager.all_steps()) == [10, 20]
    _save(ckpt, 30, params=jax.tree.map(lambda p: p + 1, _params(30)))
    ckpt.wait()
  finally:
    ckpt.close()
  params, _, step = load_params(str(run))
  assert step == 30
  _assert_tree_equal(params, jax.tree.map(lambda p: p + 1, _params(30)))


def test_restore_latest_skips_several_and_takes_a_fresh_name_aside(run):
  ckpts = run / "checkpoints"
  (run / "unreadable_checkpoints" / "30").mkdir(parents=True)  # from an earlier fallback
  _damage(ckpts / "30", "commit_success.txt", "delete")
  _damage(ckpts / "20", "meta/metadata", "truncate")
  ckpt = Checkpointer(ckpts, keep=3)
  try:
    restored = ckpt.restore_latest(*_abstract())
    assert ckpt.latest_step() == 10
  finally:
    ckpt.close()
  assert restored.step == 10
  _assert_tree_equal(restored.params, _params(10))
  assert [s for s, _ in restored.skipped] == [30, 20]
  assert restored.skipped[0][1] == "partial (no commit_success.txt)"
  assert restored.skipped[1][1].startswith("meta is corrupted (")
  assert _steps_on_disk(run / "unreadable_checkpoints") == ["20", "30", "30.1"]
  assert _steps_on_disk(ckpts) == ["10"]


def test_restore_latest_with_no_readable_step_moves_nothing(run):
  ckpts = run / "checkpoints"
  _damage(ckpts / "30", "params", "delete")
  _damage(ckpts / "20", "params/_METADATA", "garbage")
  _damage(ckpts / "10", "opt_state/ocdbt.process_0/d/*", "truncate")
  ckpt = Checkpointer(ckpts, keep=3)
  try:
    with pytest.raises(CheckpointError) as e:
      ckpt.restore_latest(*_abstract())
  finally:
    ckpt.close()
  message = str(e.value)
  assert "step 30: partial (params missing)" in message
  assert "step 20: params is corrupted (" in message
  assert "step 10: opt_state is corrupted (" in message
  assert "does not start from scratch" in message and f"mv {ckpts} {ckpts}.old" in message
  assert "\n" not in message
  assert _steps_on_disk(ckpts) == ["10", "20", "30"]
  assert not (run / "unreadable_checkpoints").exists()


def test_restore_latest_of_another_model_is_an_error_not_a_fallback(run):
  ckpts = run / "checkpoints"
  abstract_params, abstract_opt = _abstract()
  abstract_params["layer"]["kernel"] = jax.ShapeDtypeStruct((32, 128), jnp.float32)
  ckpt = Checkpointer(ckpts, keep=3)
  try:
    with pytest.raises(CheckpointError) as e:
      ckpt.restore_latest(abstract_params, abstract_opt)
  finally:
    ckpt.close()
  assert f"checkpoint {ckpts / '30'} does not fit this model" in str(e.value)
  assert "['layer']['kernel'] stored (32, 64), model (32, 128)" in str(e.value)
  assert _steps_on_disk(ckpts) == ["10", "20", "30"]


def test_restore_of_a_corrupted_step_names_the_item(run):
  ckpts = run / "checkpoints"
  _damage(ckpts / "30", "opt_state/manifest.ocdbt", "garbage")
  ckpt = Checkpointer(ckpts, keep=3)
  try:
    with pytest.raises(CheckpointError, match=r"checkpoints/30 cannot be read: opt_state is corr"):
      ckpt.restore(30, *_abstract())
  finally:
    ckpt.close()


def _assert_kept(run, message, step):
  ckpts = run / "checkpoints"
  assert f"could not save the checkpoint of step {step} in {ckpts} (OSError: [Errno 28] No space " \
         "left on device). Free some disk space first." in message, message
  assert f"The last good checkpoint, step 30 ({ckpts / '30'}), is kept; rerunning the same " \
         "command resumes from it." in message
  assert [p for p in _steps_on_disk(ckpts) if p.isdigit()] == ["10", "20", "30"]
  params, _, last = load_params(str(run))
  assert last == 30
  _assert_tree_equal(params, _params(30))


def _no_space(*args, **kwargs):
  raise OSError(errno.ENOSPC, "No space left on device")


def test_synchronous_save_failure_is_a_save_error_and_keeps_the_checkpoints(run, monkeypatch):
  ckpt = Checkpointer(run / "checkpoints", keep=3, async_save=False)
  monkeypatch.setattr(ckpt.manager, "save", _no_space)
  with pytest.raises(CheckpointSaveError) as e:
    _save(ckpt, 40)
  ckpt.close()
  assert isinstance(e.value, RunError) and e.value.exit_code == 1
  _assert_kept(run, str(e.value), 40)


def test_asynchronous_save_failure_surfaces_at_wait(run, monkeypatch):
  """The background write of a JSON item fails: Orbax re-raises it once at the next wait or save."""
  async def no_space(self, x, directory):
    _no_space()
  ckpts = run / "checkpoints"
  ckpt = Checkpointer(ckpts, keep=3)
  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", no_space)
  _save(ckpt, 40)  # returns: the write goes on in the background
  with pytest.raises(CheckpointSaveError) as e:
    ckpt.wait()
  # Retention (keep=3) would have removed step 10 after a good save of 40: not after a failed one.
  _assert_kept(run, str(e.value), 40)
  assert ckpt.latest_step() == 30 and list(ckpt.manager.all_steps()) == [10, 20, 30]
  ckpt.close()  # the error was reported once


def test_asynchronous_save_failure_surfaces_at_the_next_save_under_its_step(run, monkeypatch):
  async def no_space(self, x, directory):
    _no_space()
  ckpts = run / "checkpoints"
  ckpt = Checkpointer(ckpts, keep=3)
  with monkeypatch.context() as m:
    m.setattr(ocp.JsonCheckpointHandler, "_save_fn", no_space)
    _save(ckpt, 40)
    with pytest.raises(CheckpointSaveError) as e:
      _save(ckpt, 50)
  _assert_kept(run, str(e.value), 40)
  assert not (ckpts / "50").exists()
  # Once the disk has room again the same step saves (over Orbax's leftover tmp folder).
  _save(ckpt, 40)
  ckpt.close()
  assert _steps_on_disk(ckpts) == ["20", "30", "40"]
  assert load_params(str(run))[2] == 40


def test_asynchronous_save_failure_surfaces_at_close(run, monkeypatch):
  async def no_space(self, x, directory):
    _no_space()
  ckpt = Checkpointer(run / "checkpoints", keep=3)
  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", no_space)
  _save(ckpt, 40)
  with pytest.raises(CheckpointSaveError) as e:
    ckpt.close()
  _assert_kept(run, str(e.value), 40)


def test_a_save_that_returns_without_committing_is_a_save_error(run, monkeypatch):
  """Errors Orbax only logs: the step folder is checked for its commit marker after the wait."""
  ckpts = run / "checkpoints"
  ckpt = Checkpointer(ckpts, keep=3, async_save=False)
  save = ckpt.manager.save

  def save_then_lose_marker(step, **kwargs):
    saved = save(step, **kwargs)
    (ckpts / str(step) / "commit_success.txt").unlink()
    return saved
  monkeypatch.setattr(ckpt.manager, "save", save_then_lose_marker)
  with pytest.raises(CheckpointSaveError, match=r"step 40 .*partial \(no commit_success.txt\).*"
                                                r"last good checkpoint, step 30"):
    _save(ckpt, 40)
  ckpt.close()


def test_first_save_failure_says_nothing_is_kept(tmp_path, monkeypatch):
  ckpt = Checkpointer(tmp_path / "checkpoints", keep=2, async_save=False)
  monkeypatch.setattr(ckpt.manager, "save", _no_space)
  with pytest.raises(CheckpointSaveError, match="No earlier checkpoint was saved; rerunning the "
                                                "same command starts the run again"):
    _save(ckpt, 5)
  ckpt.close()


def test_has_checkpoints(run, tmp_path):
  assert has_checkpoints(run)
  assert not has_checkpoints(tmp_path / "fresh")
