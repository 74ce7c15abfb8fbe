"""What a router family, an optimizer or a schedule declares is checked as it registers: a key
of the section itself is refused, a key shared with one registered before must mean the same;
a refused registration adds nothing (no key, no name)."""
from __future__ import annotations

import dataclasses

import optax
import pytest

from runner.config.checks import at_least, key, positive, rate
from runner.config.registries import OPTIMIZERS, ROUTERS, SCHEDULES
from runner.config.schema import OptimConfig, RouterConfig, ScheduleConfig
from runner.errors import ConfigError
from runner.models.moe.routers import RouterFamily, register as register_router
from runner.train import optimizers, schedules


def _keys(section) -> list[str]:
  return [f.name for f in dataclasses.fields(section)]


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
