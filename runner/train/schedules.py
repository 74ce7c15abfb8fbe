"""Learning-rate schedules: linear warmup, then constant, linear, cosine or rsqrt decay (or a
plug-in's, registered by name).

A schedule that reads keys of its own declares them in a `Config` dataclass registered with it
(`register`), which adds them to the schema's `ScheduleConfig` (rsqrt: timescale,
cooldown_steps); `ScheduleConfig` itself holds what every schedule reads (name, warmup_steps)
and end_lr_fraction, which those that decay to it say they read (linear, cosine). The warm-up's
rules against the run's length are stated here too (`warmup_problem`, `warmup_warning`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from runner.config import components, registries
from runner.config.checks import at_least, key
from runner.config.relations import relation
from runner.config.schema import OptimConfig, ScheduleConfig, TrainConfig


def make_schedule(name: str, lr: float, total_steps: int, warmup_steps: int = 0,
                  end_lr_fraction: float = 0.0, **options):
  """A function step -> learning rate, for `total_steps` optimizer steps (step 0 is the first).
  `options` are schedule.* keys: the schedule reads those its Config declares (their defaults
  where not given) and ignores the others.

  Every schedule is multiplied by the warmup min(1, (step + 1) / W) (1 without warmup), so the
  first step already has a non-zero rate and step W - 1 the full one. With
  W = min(warmup_steps, total_steps), T = total_steps, p = clip((step - W) / max(T - W, 1), 0, 1):
    constant  lr
    linear    end + (lr - end) * (1 - p), end = lr * end_lr_fraction
    cosine    end + (lr - end) * (1 + cos(pi * p)) / 2
    rsqrt     lr * sqrt(t / (t + max(0, step + 1 - W))) with t = timescale, else W, else 10000;
              i.e. lr / sqrt(1 + n / t), n the steps since the end of warmup counting this one.
              With cooldown_steps = C > 0 it is then multiplied by clip((T - step) / C, 0, 1): a
              linear cooldown over the last C steps on top of the still decaying rsqrt (as
              big_vision's create_learning_rate_schedule), 1/C of the rsqrt value at step T - 1.
  Against vmoe's `big_vision_rsqrt_schedule` (vmoe/train/schedule.py), whose linear warmup starts
  at 0 at count 0: ours(step) = vmoe(step + 1) during warmup and decay. In the cooldown vmoe
  holds the rate reached when the cooldown starts and decays that linearly, at count step + 1
  lr / sqrt(1 + (T - W - C) / t) * (T - step - 1) / C."""
  chosen = registries.SCHEDULES.get(name)
  make_value, values = chosen.fn, chosen.values(options)
  warmup_steps = min(warmup_steps, total_steps)
  decay_steps = max(total_steps - warmup_steps, 1)
  end = lr * end_lr_fraction

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = jnp.minimum(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
    value = make_value(step, lr=lr, end=end, progress=progress, warmup_steps=warmup_steps,
                       total_steps=total_steps, **values)
    return value * warm
  return schedule


def register(name: str, Config: type | None = None, problem=None, reads: tuple[str, ...] = ()):
  """Registers `schedule.name=<name>` (a decorator, for the built-ins and a plug-in's): a function
  `(step, *, lr, end, progress, warmup_steps, total_steps, <its Config's keys>) -> rate`
  (traced: use jnp), where `progress` in [0, 1] is the share of the steps after warmup done and
  `end` = lr * end_lr_fraction. `make_schedule` multiplies it by the warmup, so every schedule
  reads schedule.warmup_steps. `reads=("end_lr_fraction",)` says that it uses `end`;
  `problem(schedule, steps, length)` states its rules against the run's optimizer steps (`length`:
  where they come from, e.g. "train.steps=20"); `Config` as runner/config/components.py says."""
  def wrap(value):
    components.register(components.SCHEDULE, name, value, Config, problem, reads)
    return value
  return wrap


@register("constant")
def _constant(step, *, lr, **_):
  return lr


@register("linear", reads=("end_lr_fraction",))
def _linear(step, *, lr, end, progress, **_):
  return end + (lr - end) * (1.0 - progress)


@register("cosine", reads=("end_lr_fraction",))
def _cosine(step, *, lr, end, progress, **_):
  return end + (lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))


@dataclasses.dataclass
class RsqrtConfig:
  """schedule.* of schedule.name=rsqrt."""
  timescale: Optional[int] = key(None, at_least(1), "rsqrt; null: warmup_steps (or 10000)")
  cooldown_steps: int = key(0, at_least(0), "rsqrt: final linear cooldown to zero")


def _cooldown_after_warmup(schedule, steps: int, length: str) -> str | None:
  """The cooldown starts after the warm-up ends."""
  warmup, cooldown = schedule.warmup_steps, schedule.cooldown_steps
  if cooldown and warmup + cooldown > steps:
    return (f"schedule.warmup_steps={warmup} and schedule.cooldown_steps={cooldown} take "
            f"{warmup + cooldown} steps, more than the run ({length}): rsqrt's cooldown would "
            "start before its warm-up ends; shorten them to warmup_steps + cooldown_steps <= "
            f"{steps}.")
  return None


@register("rsqrt", RsqrtConfig, _cooldown_after_warmup)
def _rsqrt(step, *, lr, warmup_steps, total_steps, timescale, cooldown_steps, **_):
  """From the end of warmup, with an optional linear cooldown to zero at the end."""
  t = float(timescale or warmup_steps or 10_000)  # warmup_steps: already capped at total_steps
  value = lr * jnp.sqrt(t / (t + jnp.maximum(step + 1 - warmup_steps, 0)))
  if cooldown_steps:
    value = value * jnp.clip((total_steps - step) / cooldown_steps, 0.0, 1.0)
  return value


def warmup_problem(schedule: ScheduleConfig, optim: OptimConfig, steps: int,
                   length: str) -> str | None:
  """A warm-up as long as the run never reaches optim.lr and never decays: the run would not be
  the schedule asked for; then the chosen schedule's own rules against the run (its `problem`).
  `length` says where the run's steps come from (`train.steps=20`)."""
  warmup = schedule.warmup_steps
  if warmup and warmup >= steps:
    last = optim.lr * steps / warmup
    return (f"schedule.warmup_steps={warmup} is not shorter than the run ({length}): the "
            f"learning rate would rise for the whole run, to {last:.3g} at its last step, never "
            f"reaching optim.lr={optim.lr:g} nor decaying (schedule={schedule.name}); give a "
            "warm-up shorter than the run, e.g. "
            + (f"schedule.warmup_steps={steps // 5} (a fifth of it) or " if steps >= 5 else "")
            + "schedule.warmup_steps=0.")
  chosen = registries.SCHEDULES.get(schedule.name)  # its own rules (rsqrt: the cooldown)
  return chosen.problem(schedule, steps, length) if chosen.problem else None


def warmup_warning(schedule: ScheduleConfig, steps: int, length: str) -> str | None:
  """A warm-up longer than half the run still peaks and decays, but it is most of the run: said
  once as the stage starts, since shrinking train.steps alone keeps the recipe's warm-up."""
  warmup = schedule.warmup_steps
  if warmup and 2 * warmup > steps:
    left = steps - warmup
    return (f"schedule.warmup_steps={warmup} is {warmup / steps:.0%} of the run ({length}), "
            f"leaving {left} step{'s' if left > 1 else ''} of schedule={schedule.name} after "
            "it; set schedule.warmup_steps to change that.")
  return None


@relation
def warmup_fits_the_run(schedule: ScheduleConfig, optim: OptimConfig, train: TrainConfig):
  """With train.steps given; a run of train.epochs is checked once its split size is known
  (runner/training/fit.py)."""
  if train.steps is None:
    return None
  return warmup_problem(schedule, optim, train.steps, f"train.steps={train.steps}")
