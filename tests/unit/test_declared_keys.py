"""What a router family, an optimizer or a schedule declares is checked as it registers: a key
of the section itself is refused, a key shared with one registered before must mean the same;
a refused registration adds nothing (no key, no name)."""
from __future__ import annotations

import dataclasses

import optax
import pytest

from runner.config.checks import at_least, key, positive, rate
from runner.config.registries import OPTIMIZERS, ROUTERS, SCHEDULES
from runner.config import sections
from runner.config.schema import OptimConfig, RouterConfig, ScheduleConfig
from runner.errors import ConfigError
from runner.models.moe.routers import RouterFamily, register as register_router
from runner.train import optimizers, schedules


def _keys(section) -> list[str]:
  return list(sections.fields_of(section))


@dataclasses.dataclass
class _Lr:
  lr: float = key(0.1, positive())


@dataclasses.dataclass
class _Name:
  name: str = "x"


@dataclasses.dataclass
class _OtherB1:
  fresh: int = key(1, at_least(1))  # listed first: a refusal must not add it
  b1: float = key(0.5, rate())


@pytest.mark.parametrize("Config, message", [
    (_Lr, "optimizer 'clash' declares the key `lr`, which every optimizer reads: rename it."),
    (_Name, "optimizer 'clash' declares the key `name`, which chooses the optimizer: rename it."),
    (_OtherB1, "optimizer 'clash' declares optim.b1 with another type or default than an "
               "optimizer registered before it: a key shared by optimizers must mean the same; "
               "rename it, or give it the same type and default."),
])
def test_an_optimizer_declares_only_keys_of_its_own(Config, message):
  before = _keys(OptimConfig)
  with pytest.raises(ConfigError) as e:
    optimizers.register("clash", Config)(lambda **_: optax.identity())
  assert str(e.value) == message
  assert _keys(OptimConfig) == before and "clash" not in OPTIMIZERS


@dataclasses.dataclass
class _Warmup:
  warmup_steps: int = key(5, at_least(0))


@dataclasses.dataclass
class _OtherCooldown:
  cooldown_steps: int = key(10, at_least(0))


def test_a_schedule_declares_only_keys_of_its_own():
  before = _keys(ScheduleConfig)
  with pytest.raises(ConfigError, match=r"^schedule 'clash' declares the key `warmup_steps`, "
                     r"which every schedule reads: rename it\.$"):
    schedules.register("clash", _Warmup)(lambda step, **_: 1.0)
  with pytest.raises(ConfigError, match=r"^schedule 'clash' declares schedule.cooldown_steps "
                     r"with another type or default than a schedule registered before it"):
    schedules.register("clash", _OtherCooldown)(lambda step, **_: 1.0)
  assert _keys(ScheduleConfig) == before and "clash" not in SCHEDULES


@dataclasses.dataclass
class _Type:
  type: str = "x"


@dataclasses.dataclass
class _OtherK:
  k: int = key(1, at_least(1))


def test_a_router_family_declares_only_keys_of_its_own():
  before = _keys(RouterConfig)
  for Config, message in (
      (_Type, "router family 'clash' declares the key `type`, which chooses the family: rename "
              "it."),
      (_OtherK, "router family 'clash' declares model.router.k with another type or default "
                "than a family registered before it: a key shared by families must mean the "
                "same; rename it, or give it the same type and default.")):
    family = type("Clash", (RouterFamily,), {"name": "clash", "Config": Config})
    with pytest.raises(ConfigError) as e:
      register_router(family)
    assert str(e.value) == message
  assert _keys(RouterConfig) == before and "clash" not in ROUTERS


@dataclasses.dataclass
class _Fresh:
  taken_name_key: int = key(1, at_least(1))


def test_a_taken_name_is_refused_before_its_keys_join_the_schema():
  before = {section: _keys(section) for section in (OptimConfig, ScheduleConfig, RouterConfig)}

  def another_adam(**_):
    return optax.identity()

  def another_linear(step, **_):
    return step

  class AnotherTokenChoice(RouterFamily):
    name = "token_choice"
    Config = _Fresh

  for register in (lambda: optimizers.register("adam", _Fresh)(another_adam),
                   lambda: schedules.register("linear", _Fresh)(another_linear),
                   lambda: register_router(AnotherTokenChoice)):
    with pytest.raises(ConfigError, match="is registered twice"):
      register()
  assert {section: _keys(section) for section in before} == before
  assert OPTIMIZERS.get("adam") is not another_adam and ROUTERS.get("token_choice") is not \
      AnotherTokenChoice


@dataclasses.dataclass
class _Late:
  late_key: int = key(1, at_least(1))


def test_keys_declared_after_the_schema_is_made_are_refused():
  """This process has composed configs: the sections are dataclasses, made once; a registration
  that would add keys now is refused and adds nothing, a re-registration of the same keys is a
  no-op."""
  sections.build()
  made = {section: sections.built(section) for section in (OptimConfig, ScheduleConfig, RouterConfig)}
  before = {section: _keys(section) for section in made}
  with pytest.raises(ConfigError, match=r"^optimizer 'late' declares keys \(late_key\) after the "
                     r"schema was made .* load the module with plugins=\[\.\.\.\]"):
    optimizers.register("late", _Late)(lambda **_: optax.identity())
  family = type("Late", (RouterFamily,), {"name": "late", "Config": _Late})
  with pytest.raises(ConfigError, match=r"^router family 'late' declares keys \(late_key\)"):
    register_router(family)
  token_choice = ROUTERS.get("token_choice")
  register_router(token_choice)  # the same family's keys again (a module imported twice): no-op
  assert ROUTERS.get("token_choice") is token_choice
  sections.build()
  assert {section: _keys(section) for section in made} == before
  assert {section: sections.built(section) for section in made} == made
  assert all(_keys(section) == [f.name for f in dataclasses.fields(made[section])]
             for section in made)  # what the built classes hold
  assert "late" not in OPTIMIZERS and "late" not in ROUTERS


_BEFORE_USE = """
import dataclasses
from runner.config import schema, sections
from runner.train import optimizers
assert not sections.is_built(), "made before its first use"
assert "b1" in [f.name for f in dataclasses.fields(optimizers.AdamConfig)]
assert not dataclasses.fields(schema.OptimConfig)  # the section itself holds no key, ever
optim = sections.new(schema.OptimConfig, lr=0.5)  # the first use makes every open section, once
assert sections.is_built() and optim.b1 == 0.9 and optim.lr == 0.5
assert isinstance(optim, schema.OptimConfig) and not dataclasses.fields(schema.OptimConfig)
print([f.name for f in dataclasses.fields(optim)])
"""


def test_the_sections_are_made_at_their_first_use_with_the_keys_registered_by_then():
  import json
  import subprocess
  import sys
  done = subprocess.run([sys.executable, "-c", _BEFORE_USE], capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  names = json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"'))
  assert names[:4] == ["name", "lr", "weight_decay", "grad_clip_norm"] and "b1" in names


_JOB_PROCESS = """
import dataclasses, pickle, sys
# Hydra's submitit launcher pickles itself with the composed config before the job: in the job's
# process the config comes first, and finding its classes registers the built-ins, then builds.
cfg = pickle.loads(open(sys.argv[2], 'rb').read())  # the config composed before submission
from runner.config import sections
from omegaconf import OmegaConf
router = OmegaConf.get_type(cfg.model.router)  # the built class, with every family's keys
assert sections.is_built() and "k" in [f.name for f in dataclasses.fields(router)]
job = pickle.loads(open(sys.argv[1], 'rb').read())  # registers again: nothing new
from runner import config as config_layer
typed = config_layer.load("pretrain", cfg, "unused", check=False)  # makes the schema here
print(type(typed.model.router).__name__, typed.model.router.k, typed.optim.b1)
import runner.command.config_store
runner.command.config_store.register_configs()  # Hydra's store, as the launcher's pickled state brings it
from runner.command import compose
composed = compose.compose(None, "pretrain", ["model=vmoe_tiny", "optim.b1=0.7", "workdir=unused"])
typed = config_layer.load(job.sub, composed, "unused", check=False)
print(type(job).__name__, job.sub, job.devices_checked, typed.optim.b1)
"""


def test_a_job_in_a_process_of_its_own_registers_before_its_config_is_composed_or_typed(tmp_path):
  """SLURM's launcher (submitit) unpickles the task function in the job's own process, and
  composes the job's config there before calling it: unpickling the job registers the built-ins
  (and the plug-ins this process loaded) first (runner/command/job.py), so the schema, made at
  the first use there, has every optimizer's and router family's keys, whether that use is
  typing a config composed before submission or composing one."""
  import pickle
  import subprocess
  import sys

  from runner.command import compose
  from runner.command.job import Job
  cfg = compose.compose(None, "pretrain", ["model=vmoe_tiny", "model.router.k=1", "optim.b1=0.8",
                                          f"workdir={tmp_path / 'run'}"])
  (tmp_path / "cfg.pkl").write_bytes(pickle.dumps(cfg))
  (tmp_path / "job.pkl").write_bytes(pickle.dumps(Job("pretrain", tmp_path, True)))
  done = subprocess.run([sys.executable, "-c", _JOB_PROCESS, str(tmp_path / "job.pkl"),
                         str(tmp_path / "cfg.pkl")], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split()[-7:] == ["RouterConfig", "1", "0.8", "Job", "pretrain", "True", "0.7"]
