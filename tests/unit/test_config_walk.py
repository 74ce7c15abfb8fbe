"""The run config walks down from the task to the train step: from `vmoe pretrain`'s and `vmoe
finetune`'s task (pretrain from scratch, as a classifier and as two contrastive towers; finetune
from a checkpoint upcycled into experts) to the making of the train step, it climbs back up to a
higher room at most 5 times (tests/config_walk.py says how the walk is recorded and a climb
counted). What the step needs is worked out by runner/train/start.py alone, and the walk passes
through it."""
from __future__ import annotations

import pytest

import config_walk
from conftest import QUIET, TINY_MODEL, TINY_TEXT
from runner import builtins, config as config_layer
from runner.checkpoints import weights
from runner.command import compose, config_store
from runner.stages import setup
from runner.tasks import finetune, pretrain
from runner.train import loop

SMALL = [*TINY_MODEL, *QUIET, "train.steps=1", "schedule.warmup_steps=0", "data.batch_size=16"]


def _walk(task, run, overrides, workdir, monkeypatch) -> config_walk.Walk:
  builtins.register()
  config_store.register_configs()
  cfg = compose.compose(None, task, [*SMALL, *overrides, f"workdir={workdir}"])
  checkpoints = weights.Checkpoints()
  typed = config_layer.load(task, cfg, str(workdir), checkpoints=checkpoints)
  placement = setup.start(typed, task)

  def reached(*_, **__):
    raise config_walk._Reached
  monkeypatch.setattr(loop, "make_train_step", reached)
  return config_walk.walk(run, typed, placement, checkpoints)


# pretrain's image-text branch (objective=contrastive): a one-block text tower.
CONTRASTIVE = ["objective=contrastive", *TINY_TEXT]


@pytest.mark.parametrize("task, run, upstream, extra, start", [
    ("pretrain", pretrain.run, None, [], "start.classifier"),
    ("pretrain", pretrain.run, None, CONTRASTIVE, "start.towers"),
    ("finetune", finetune.run, "vit_1step", [], "start.classifier")],
    ids=["pretrain-from-scratch", "pretrain-contrastive", "finetune-upcycled"])
def test_the_config_climbs_back_up_at_most_five_times(task, run, upstream, extra, start,
                                                      shared_run, tmp_path, monkeypatch):
  overrides = list(extra)
  if upstream:
    overrides += [f"init.checkpoint={shared_run(upstream)}", "init.dense_to_experts=true",
                  "model=vmoe_tiny"]
  walk = _walk(task, run, overrides, tmp_path / "run", monkeypatch)
  functions = [function for _, function in walk.calls]
  assert functions[0] == f"{task}.run" and start in functions
  assert ("start._from_checkpoint" in functions) == bool(upstream)
  assert walk.climbs <= 5, f"{walk.climbs} climbs: {' -> '.join(walk.rooms)}\n{walk.describe()}"
