"""A researcher's own optimizer and schedule, each declaring keys of its own, through the CLI:
their keys compose, are typed and range-checked like a built-in's, their relations are checked
before compute, and a short pretraining run builds them from those keys' values.

The commands run in one process of their own (conftest.vmoe_driver): registering adds keys to the
schema of the process that loads the plug-in, which must not leak into the other tests of this
process.
"""
from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from conftest import QUIET, TINY_MODEL, fails_clearly, nothing_like_a_run, vmoe_driver

pytestmark = pytest.mark.xdist_group("plugin_training")

# Lion (Chen et al. 2023) with a key shared with adam (b1: the same type and default) and one of
# its own, and a step schedule with a key of its own; each with a relation. What each is built
# with is written to a file, so the test sees the values the run used.
SOURCE = '''
import dataclasses
import json
import pathlib

import jax.numpy as jnp
import optax

from runner.config.checks import at_least, key, rate
from runner.train import optimizers, schedules


@dataclasses.dataclass
class LionConfig:
  b1: float = key(0.9, rate())
  lion_b2: float = key(0.99, rate(), "lion: the slower average, of the momentum")


def _b2_slower(optim):
  if optim.lion_b2 <= optim.b1:
    return (f"optim.lion_b2={optim.lion_b2} must be above optim.b1={optim.b1}: the momentum "
            "averages more slowly than the update's interpolation.")


@optimizers.register("lion", LionConfig, _b2_slower)
def lion(*, b1, lion_b2):
  pathlib.Path("lion.json").write_text(json.dumps({"b1": b1, "lion_b2": lion_b2}))
  return optax.scale_by_lion(b1=b1, b2=lion_b2)


@dataclasses.dataclass
class StepConfig:
  drops: int = key(2, at_least(1), "step: times the rate drops tenfold")


def _drops_fit(schedule, steps, length):
  if schedule.drops >= steps:
    return f"schedule.drops={schedule.drops} needs more steps than the run has ({length})."


@schedules.register("step", StepConfig, _drops_fit)
def step_decay(step, *, lr, progress, drops, **_):
  pathlib.Path("step.json").write_text(json.dumps({"drops": drops}))
  return lr * 0.1 ** jnp.floor(progress * drops)
'''

PLUGIN = ["plugins=[lab_training]", "optim.name=lion", "schedule.name=step"]
SHORT = [*TINY_MODEL, *QUIET, "train.steps=3", "schedule.warmup_steps=0", "data.batch_size=16",
         "eval.every_steps=0", "checkpoint.every_steps=0"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> pathlib.Path:
  folder = tmp_path_factory.mktemp("lab")
  (folder / "lab_training.py").write_text(SOURCE)
  return folder


@pytest.fixture(scope="module")
def vmoe(lab):
  """`vmoe <args>` in the lab, in the one process of this module's commands."""
  with vmoe_driver(lab) as driver:
    yield driver


def test_declared_keys_compose_with_their_defaults(vmoe):
  code, out, err = vmoe("pretrain", *PLUGIN, "optim.lion_b2=0.95", "--cfg", "job")
  assert code == 0, err[-3000:]
  config = yaml.safe_load(out)
  assert config["optim"]["lion_b2"] == 0.95 and config["optim"]["b1"] == 0.9
  assert config["schedule"]["drops"] == 2


def test_a_run_builds_them_from_their_keys(vmoe, lab, tmp_path):
  workdir = tmp_path / "w"
  code, _, err = vmoe("pretrain", f"workdir={workdir}", *SHORT, *PLUGIN, "optim.lion_b2=0.95",
                      "schedule.drops=1")
  assert code == 0, err[-3000:]
  assert json.loads((lab / "lion.json").read_text()) == {"b1": 0.9, "lion_b2": 0.95}
  assert json.loads((lab / "step.json").read_text()) == {"drops": 1}
  recorded = yaml.safe_load((workdir / "config.yaml").read_text())
  assert recorded["optim"]["lion_b2"] == 0.95 and recorded["schedule"]["drops"] == 1


@pytest.mark.parametrize("args, expected", [
    pytest.param(["optim.lion_b2=1.5"], ["optim.lion_b2=1.5", "[0, 1)"], id="optimizer-range"),
    pytest.param(["optim.lion_b2=fast"], ["optim.lion_b2"], id="optimizer-type"),
    pytest.param(["schedule.drops=0"], ["schedule.drops=0", ">= 1"], id="schedule-range"),
    pytest.param(["optim.lion_b2=0.5"], ["optim.lion_b2=0.5 must be above optim.b1=0.9"],
                 id="optimizer-relation"),
    pytest.param(["schedule.drops=3"], ["schedule.drops=3 needs more steps than the run has "
                                        "(train.steps=3)"], id="schedule-relation"),
])
def test_bad_values_fail_before_compute(args, expected, vmoe, tmp_path):
  workdir = tmp_path / "w"
  fails_clearly(vmoe("pretrain", f"workdir={workdir}", *SHORT, *PLUGIN, *args), *expected)
  nothing_like_a_run(workdir)
