"""Declarative validation: each field's check and the relations between keys, on a composed config.

A bad value fails in `validate`, before any compute, with one paragraph that names the key, the
value given and what is valid; several problems are listed together. Relations that depend on the
device count run only once it is known.
"""
from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
import typing

import pytest
from hydra import compose, initialize_config_dir

from runner.config import conf_dir, schema, sections, validate
from runner.config.checks import Check
from runner.config.resolve import train_task
from runner.config.schema import TrainTask
from runner.config.validate import problems
from runner.errors import ConfigError


@pytest.fixture(scope="module")
def default_task() -> TrainTask:
  """`vmoe pretrain` with no overrides: vmoe_tiny (8 experts, group 8) on mnist5k, batch 128."""
  with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
    cfg = compose("pretrain")
  return train_task(cfg, "/tmp/w")


@pytest.fixture
def task(default_task) -> TrainTask:
  return copy.deepcopy(default_task)


def _set(task, key: str, value):
  *sections, name = key.split(".")
  node = task
  for section in sections:
    node = getattr(node, section)
  assert hasattr(node, name), key
  setattr(node, name, value)


def _error(task, devices=None) -> str:
  with pytest.raises(ConfigError) as e:
    validate(task, devices=devices)
  return str(e.value)


@pytest.mark.parametrize("stage,overrides", [
    ("pretrain", ["model=vit_tiny"]), ("finetune", ["model=vit_tiny"]),
    ("finetune", ["experiment=router_vit"]), ("finetune", ["model=vit_s32"]),
    ("pretrain", ["experiment=router_vit"]), ("finetune", ["experiment=head_det"])])
def test_a_stage_recipe_is_valid_for_a_dense_vit(stage, overrides):
  """The fine-tuning recipe's expert dropout (conf/finetune.yaml) is no error on a ViT, which
  has no expert to drop: the stage's own defaults are not the user's mistakes."""
  with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
    cfg = compose(stage, overrides + ["init.checkpoint=runs/x"] * (stage == "finetune"))
  config = train_task(cfg, "/tmp/w")
  assert validate(config) is config


def test_the_default_config_is_valid(default_task):
  assert default_task.model.moe.num_experts == 8 and default_task.model.moe.group_size == 8
  assert default_task.data.batch_size == 128
  assert validate(default_task) is default_task
  assert validate(default_task, devices=1) is default_task
  assert validate(default_task, devices=8) is default_task


# key, bad value, what the message must say (beyond "key=value"): the valid range or choices.
FIELD_CASES = [
    ("train.steps", -5, "train.steps=-5 must be >= 1"),
    ("optim.lr", -0.1, "optim.lr=-0.1 must be > 0"),
    ("optim.lr", 0, "optim.lr=0 must be > 0"),
    ("data.batch_size", 0, "data.batch_size=0 must be >= 1"),
    ("model.dropout_rate", 1.0, "model.dropout_rate=1.0 must be in [0, 1)"),
    ("model.router.capacity_ratio", 0, "model.router.capacity_ratio=0 must be > 0"),
    ("schedule.end_lr_fraction", 1.5, "schedule.end_lr_fraction=1.5 must be in [0, 1]"),
    ("eval.every_steps", -1, "eval.every_steps=-1 must be >= 0"),
    ("checkpoint.keep", 0, "checkpoint.keep=0 must be >= 1"),
    ("fewshot.shots", [0], "fewshot.shots=[0] has the item 0, which must be >= 1"),
    ("fewshot.l2_regs", [1, 0.5], "fewshot.l2_regs=[1, 0.5] must be strictly increasing"),
    ("optim.weight_decay", [["(", 1.0]],  # a bad regex
     "optim.weight_decay=[['(', 1.0]] must be a number >= 0 or a list of [regex, value >= 0] "
     "pairs"),
    ("sharding.name", "nope", "sharding.name='nope' must be one of dp, ep, fsdp_ep"),
    ("mesh.data", 0, "mesh.data=0 must be -1 (infer from the device count) or >= 1"),
]


@pytest.mark.parametrize("key,value,expected", FIELD_CASES,
                         ids=[f"{k}={v}" for k, v, _ in FIELD_CASES])
def test_a_bad_value_names_the_key_the_value_and_what_is_valid(task, key, value, expected):
  _set(task, key, value)
  message = _error(task)
  assert expected in message
  assert "problems in the config" not in message  # only this one
  assert message.endswith(".")


def test_the_hint_of_a_key_is_repeated(task):
  task.model.router.capacity_ratio = 0
  assert "1.05 upstream" in _error(task)
  task = copy.deepcopy(task)
  task.model.router.capacity_ratio = 1.05
  task.fewshot.shots = [0]
  assert "(e.g. [1,5,10,25])" in _error(task)


def _experts_then_k(task):
  task.model.router.k = 9


def _heads(task):
  task.model.hidden_size = 130  # num_heads=4


def _patches(task):
  task.model.image_size = 30  # patch_size=4


def _coordinator(task):
  task.distributed.coordinator_address = "host:1"


def _no_duration(task):
  task.train.steps = None
  task.train.epochs = None


def _fewshot_without_datasets(task):
  task.fewshot.every_steps = 5
  task.fewshot.datasets = []


def _grouped_matmul_without_dropless(task):
  task.model.moe.grouped_matmul = "ragged_dot"


RELATION_CASES = [
    (_experts_then_k, ["model.router.k=9", "model.moe.num_experts=8", "1 <= k <= 8"]),
    (_heads, ["model.hidden_size=130", "not divisible by model.num_heads=4"]),
    (_patches, ["model.image_size=30", "not divisible by model.patch_size=4"]),
    (_coordinator, ["distributed.coordinator_address=host:1", "distributed.num_processes=<n>",
                    "num_processes=None"]),
    (_no_duration, ["train.steps=<n>", "train.epochs=<x>"]),
    (_fewshot_without_datasets, ["fewshot.every_steps=5", "fewshot.datasets=[uci_digits]"]),
    (_grouped_matmul_without_dropless,
     ["model.moe.grouped_matmul=ragged_dot means nothing for model.router.type=token_choice",
      "fixed-capacity buffers", "model.router.dropless=true"]),
]


@pytest.mark.parametrize("change,expected", RELATION_CASES,
                         ids=[f.__name__.strip("_") for f, _ in RELATION_CASES])
def test_relations_between_keys(task, change, expected):
  change(task)
  message = _error(task)
  for words in expected:
    assert words in message


def test_the_coordinator_with_its_processes_is_valid(task):
  task.distributed.coordinator_address = "host:1"
  task.distributed.num_processes = 2
  task.distributed.process_id = 1
  validate(task)
  task.distributed.process_id = 2
  assert "process_id=2" in _error(task)


def test_epochs_alone_are_a_duration(task):
  """train.epochs with train.steps=null is a run's length: nothing is reported, and taking the
  epochs away again is what brings the missing-duration problem back."""
  task.train.steps = None
  task.train.epochs = 1.5
  assert problems(task) == []
  assert validate(task) is task
  assert (task.train.steps, task.train.epochs) == (None, 1.5)
  task.train.epochs = None
  assert problems(task) == ["set the training duration: train.steps=<n> or train.epochs=<x>"]


def test_several_problems_are_listed_in_one_message(task):
  task.train.steps = -5
  task.optim.lr = 0
  task.checkpoint.keep = 0
  message = _error(task)
  assert message.startswith("3 problems in the config: ")
  for words in ("train.steps=-5", "optim.lr=0", "checkpoint.keep=0"):
    assert words in message
  assert message.count(";") == 2 and message.endswith(".")


def test_several_relations_are_listed_in_one_message(task):
  _experts_then_k(task)
  _heads(task)
  _no_duration(task)
  message = _error(task)
  assert message.startswith("3 problems in the config: ")
  for words in ("model.router.k=9", "model.hidden_size=130", "train.steps=<n>"):
    assert words in message


def test_relations_wait_for_valid_fields(task):
  """A relation over an invalid value would only repeat it: field problems are reported alone."""
  task.model.router.k = 0
  task.model.hidden_size = 130
  message = _error(task)
  assert "model.router.k=0 must be >= 1" in message
  assert "num_heads" not in message


def test_device_relations_run_only_with_the_device_count(task):
  # 12 images, routing groups of 8: fine until the devices are known.
  task.data.batch_size = 12
  validate(task)
  # One device: a share smaller than a group is one (smaller) group; 12 is not a multiple of 8.
  message = _error(task, devices=1)
  assert "data.batch_size=12" in message and "model.moe.group_size=8" in message
  assert "use a multiple of 8 images" in message
  small = copy.deepcopy(task)
  small.data.batch_size = 4
  validate(small, devices=1)
  # Several devices: each device's share must be whole groups.
  message = _error(task, devices=2)
  assert "6 images per device" in message and "multiple of 16 images" in message
  task.data.batch_size = 16
  validate(task, devices=2)
  # ... and split over the devices at all.
  task.data.batch_size = 12
  task.model.moe.num_experts = 0
  task.model.moe.layers = []
  message = _error(task, devices=8)
  assert "data.batch_size=12 is not divisible by the 8 devices" in message


def test_the_mesh_is_checked_against_the_devices(task):
  task.mesh.data = 3
  validate(task)
  assert "mesh.data=3 x mesh.expert=1 = 3 devices does not match the 8 devices" in _error(
      task, devices=8)
  task.mesh.data, task.mesh.expert = -1, 3  # 8 devices, 8 experts
  assert "mesh.expert=3 does not divide the 8 devices" in _error(task, devices=8)
  task.mesh.expert = -1  # the most devices that divide the experts
  validate(task, devices=8)


# --- the schema ------------------------------------------------------------------------------


def _schemas():
  """Every config dataclass of the schema module, and the ones nested in their fields."""
  found, todo = [], [v for v in vars(schema).values() if isinstance(v, type)
                     and dataclasses.is_dataclass(v) and not issubclass(v, Check)]
  while todo:
    cls = todo.pop()
    if cls in found:
      continue
    found.append(cls)
    todo += [t for t in typing.get_type_hints(cls).values() if dataclasses.is_dataclass(t)]
  return found


def _default(f: dataclasses.Field):
  if f.default is not dataclasses.MISSING:
    return f.default
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return None


def test_every_checked_default_passes_its_own_check():
  checked = 0
  for cls in _schemas():
    for f in dataclasses.fields(cls):
      check = f.metadata.get("check")
      value = _default(f)
      if check is None or value is None:
        continue
      checked += 1
      assert check(value) is None, f"{cls.__name__}.{f.name}={value!r}: {check(value)}"
  assert checked > 50  # the walk found the schema's checks


def test_overrides_keep_the_checks_of_the_keys_they_override():
  router = {f.name: f for f in dataclasses.fields(
      sections.fields_class(typing.get_type_hints(schema.ModelOverrides)["router"]))}
  assert router["k"].metadata["check"](0) == "must be >= 1"
  assert router["k"].default is None


def test_the_library_imports_without_hydra():
  code = ("import sys\n"
          "import runner.config.schema, runner.models, runner.train, runner.evaluators\n"
          "import runner.data, runner.parallel, runner.checkpoints.checkpoint\n"
          "loaded = sorted(m for m in sys.modules if m == 'hydra' or m.startswith('hydra.'))\n"
          "assert not loaded, loaded\n"
          "assert 'runner.command.config_store' not in sys.modules\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
