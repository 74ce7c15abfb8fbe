"""One registration for every kind of component (runner/config/components.py), and the refusal of
a key of optim.* or schedule.* that the chosen optimizer or schedule does not read, as a key of
model.router.* that the chosen router family does not read is refused."""
from __future__ import annotations

import copy
import dataclasses

import pytest
from hydra import compose, initialize_config_dir

from runner.config import components, conf_dir, sections, validate
from runner.config.registries import Registered, Registry
from runner.config.resolve import train_task
from runner.config.schema import ScheduleConfig
from runner.errors import ConfigError

CONF = conf_dir()


def _task(stage: str, overrides=()):
  checkpoint = ["init.checkpoint=runs/x"] if stage == "finetune" else []
  with initialize_config_dir(config_dir=str(CONF), version_base=None):
    cfg = compose(stage, [*overrides, *checkpoint])
  return train_task(cfg, "/tmp/w")


@pytest.fixture(scope="module")
def default_task():
  return _task("pretrain")


@pytest.fixture
def task(default_task):
  return copy.deepcopy(default_task)


UNREAD_CASES = [
    ("optim", {"name": "sgd", "b2": 0.5},
     "optim.b2=0.5 means nothing for optim.name=sgd; its keys are optim.{lr, weight_decay, "
     "grad_clip_norm, momentum, nesterov}. Drop the other keys, or choose an optimizer that "
     "reads them (optim.name=adam|sgd|adafactor)."),
    ("schedule", {"name": "cosine", "cooldown_steps": 3},
     "schedule.cooldown_steps=3 means nothing for schedule.name=cosine; its keys are "
     "schedule.{warmup_steps, end_lr_fraction}. Drop the other keys, or choose a schedule that "
     "reads them (schedule.name=constant|linear|cosine|rsqrt)."),
    ("schedule", {"name": "constant", "end_lr_fraction": 0.5},
     "schedule.end_lr_fraction=0.5 means nothing for schedule.name=constant; its keys are "
     "schedule.{warmup_steps}. Drop the other keys, or choose a schedule that reads them "
     "(schedule.name=constant|linear|cosine|rsqrt)."),
    ("schedule", {"name": "rsqrt", "end_lr_fraction": 0.1, "warmup_steps": 10},
     "schedule.end_lr_fraction=0.1 means nothing for schedule.name=rsqrt; its keys are "
     "schedule.{warmup_steps, timescale, cooldown_steps}."),
    ("optim", {"name": "adam", "momentum": 0.5, "nesterov": True},
     "optim.momentum=0.5, optim.nesterov=true means nothing for optim.name=adam; its keys are "
     "optim.{lr, weight_decay, grad_clip_norm, b1, b2, eps}."),
]


@pytest.mark.parametrize("section, values, expected", UNREAD_CASES,
                         ids=[" ".join(f"{k}={v}" for k, v in c[1].items()) for c in UNREAD_CASES])
def test_a_key_the_chosen_component_does_not_read_is_refused(task, section, values, expected):
  for name, value in values.items():
    setattr(getattr(task, section), name, value)
  with pytest.raises(ConfigError) as e:
    validate(task)
  assert expected in str(e.value)
  assert "problems in the config" not in str(e.value)  # only this one


@pytest.mark.parametrize("section, values", [
    ("optim", {"name": "sgd", "b2": 0.999, "lr": 0.1, "weight_decay": 0.0,
               "grad_clip_norm": None}),  # b2 keeps its default
    ("optim", {"name": "adafactor", "b1": 0.8}),
    ("schedule", {"name": "linear", "end_lr_fraction": 0.5}),
    ("schedule", {"name": "cosine", "end_lr_fraction": 0.1, "warmup_steps": 5}),
    ("schedule", {"name": "rsqrt", "cooldown_steps": 20, "timescale": 100}),
    ("schedule", {"name": "constant", "warmup_steps": 5}),
])
def test_the_keys_it_reads_or_a_default_are_no_error(task, section, values):
  for name, value in values.items():
    setattr(getattr(task, section), name, value)
  assert validate(task) is task


PRESETS = [(stage, f"{group}={path.stem}") for stage in ("pretrain", "finetune")
           for group in ("optim", "schedule", "experiment")
           for path in sorted((CONF / group).glob("*.yaml"))]


@pytest.mark.parametrize("stage, preset", PRESETS, ids=[f"{s} {p}" for s, p in PRESETS])
def test_no_preset_sets_a_key_its_component_does_not_read(stage, preset):
  """conf/'s stages with each optimizer, schedule and experiment (the sweeps' jobs are validated
  whole in tests/unit/test_config_compose.py)."""
  task = _task(stage, [preset])
  assert components.unread_keys(components.OPTIMIZER, task.optim) is None
  assert components.unread_keys(components.SCHEDULE, task.schedule) is None


# --- the one registration --------------------------------------------------------------------

def _fresh(kind: components.Kind) -> components.Kind:
  """`kind` with a registry of its own, so that nothing registered here reaches the others."""
  return dataclasses.replace(kind, registry=Registry(kind.registry.kind, kind.registry.key))


def _decays(step, *, lr, end, progress, **_):
  return end + (lr - end) * (1.0 - progress)


def test_what_a_component_reads_decides_which_keys_it_refuses():
  kind = _fresh(components.SCHEDULE)
  assert components.register(kind, "decays", _decays, reads=("end_lr_fraction",)) == ()
  assert kind.registry.get("decays") == Registered(_decays, reads=("end_lr_fraction",))
  components.register(kind, "flat", lambda step, *, lr, **_: lr)
  section = sections.new(ScheduleConfig, name="decays", end_lr_fraction=0.5)
  assert components.unread_keys(kind, section) is None
  section.name = "flat"
  assert components.unread_keys(kind, section) == (
      "schedule.end_lr_fraction=0.5 means nothing for schedule.name=flat; its keys are "
      "schedule.{warmup_steps}. Drop the other keys, or choose a schedule that reads them "
      "(schedule.name=decays|flat).")


@pytest.mark.parametrize("reads", [("name",), ("warmup_steps",), ("timescale",), ("nope",)])
def test_it_reads_only_keys_of_the_section_that_not_every_component_reads(reads):
  kind = _fresh(components.SCHEDULE)
  with pytest.raises(ConfigError) as e:
    components.register(kind, "mine", _decays, reads=reads)
  assert str(e.value) == (
      f"schedule 'mine' reads schedule.{reads[0]}, not a key of schedule.* that a schedule may "
      "read besides its own (those are: end_lr_fraction): declare it in its Config.")
  assert "mine" not in kind.registry


def _elsewhere(fn):
  """Another function doing the same, from another module."""
  def other(*args, **kwargs):
    return fn(*args, **kwargs)
  other.__module__ = "lab.elsewhere"
  return other


def test_a_taken_name_is_refused_for_every_kind():
  for kind in (components.ROUTER, components.OPTIMIZER, components.SCHEDULE,
               components.Kind(Registry("model name", "model"))):
    kind = _fresh(kind)
    components.register(kind, "mine", _decays)
    components.register(kind, "mine", _decays)  # the same again (a module imported twice)
    with pytest.raises(ConfigError, match=f"{kind.registry.kind} 'mine' is registered twice"):
      components.register(kind, "mine", _elsewhere(_decays))


def test_a_kind_without_keys_keeps_the_value_itself():
  """Model names and embedded datasets: a name and what it stands for."""
  kind = components.Kind(Registry("embedded dataset", "data.name"))
  builder = type("Builder", (), {})
  assert components.register(kind, "mine", builder) == ()
  assert kind.registry.get("mine") is builder
