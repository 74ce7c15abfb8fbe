"""Learning-rate schedules: linear warmup, then constant, linear, cosine or rsqrt decay."""
from __future__ import annotations

import jax.numpy as jnp

SCHEDULES = ("constant", "linear", "cosine", "rsqrt")


def make_schedule(name: str, lr: float, total_steps: int, warmup_steps: int = 0,
                  end_lr_fraction: float = 0.0, timescale: int | None = None,
                  cooldown_steps: int = 0):
  """A function step -> learning rate, for `total_steps` optimizer steps."""
  if name not in SCHEDULES:
    raise ValueError(f"unknown schedule {name!r}; valid: {SCHEDULES}")
  warmup_steps = min(warmup_steps, total_steps)
  decay_steps = max(total_steps - warmup_steps, 1)
  end = lr * end_lr_fraction

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = jnp.minimum(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
    if name == "constant":
      value = lr
    elif name == "linear":
      value = end + (lr - end) * (1.0 - progress)
    elif name == "cosine":
      value = end + (lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    else:  # rsqrt from the end of warmup, with an optional linear cooldown to zero at the end
      t = float(timescale or warmup_steps or 10_000)
      value = lr * jnp.sqrt(t / (t + jnp.maximum(step + 1 - warmup_steps, 0)))
      if cooldown_steps:
        value = value * jnp.clip((total_steps - step) / cooldown_steps, 0.0, 1.0)
    return value * warm
  return schedule
