"""Learning-rate schedules against closed-form values computed by hand in the test.

Conventions checked (runner/train/schedules.py): `step` is the 0-based optimizer step; warmup is
linear with factor min(1, (step + 1) / warmup_steps); linear/cosine decay runs over
[warmup_steps, total_steps] and reaches lr * end_lr_fraction at step == total_steps.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from runner.config.registries import SCHEDULES
from runner.train.schedules import make_schedule


def values(schedule, steps):
  return np.array([float(schedule(s)) for s in steps])


def test_warmup_ramp_is_linear_and_reaches_lr_at_the_last_warmup_step():
  lr, w = 0.5, 10
  sched = make_schedule("constant", lr, total_steps=100, warmup_steps=w)
  steps = np.arange(w)
  np.testing.assert_allclose(values(sched, steps), lr * (steps + 1) / w, rtol=1e-6)
  # Strictly increasing during warmup, flat afterwards.
  np.testing.assert_allclose(values(sched, [w - 1, w, 50, 99]), [lr] * 4, rtol=1e-6)
  assert np.all(np.diff(values(sched, steps)) > 0)


def test_constant_without_warmup_is_constant():
  sched = make_schedule("constant", 3e-4, total_steps=7)
  np.testing.assert_allclose(values(sched, range(7)), 3e-4, rtol=1e-6)


@pytest.mark.parametrize("end_fraction", [0.0, 0.1])
def test_linear_decay_values(end_fraction):
  lr, total, w = 1.0, 110, 10
  end = lr * end_fraction
  sched = make_schedule("linear", lr, total_steps=total, warmup_steps=w,
                        end_lr_fraction=end_fraction)
  for step in [10, 35, 60, 85, 109, 110]:
    progress = (step - w) / (total - w)
    assert float(sched(step)) == pytest.approx(end + (lr - end) * (1 - progress), rel=1e-5,
                                               abs=1e-7)
  # Midpoint of the decay is the average of lr and the end value.
  assert float(sched(60)) == pytest.approx((lr + end) / 2, rel=1e-6)
  # End value reached at step == total_steps and held after.
  assert float(sched(total)) == pytest.approx(end, abs=1e-7)
  assert float(sched(total + 50)) == pytest.approx(end, abs=1e-7)
  # Decay is monotone.
  v = values(sched, range(w, total + 1))
  assert np.all(np.diff(v) <= 1e-7)


@pytest.mark.parametrize("end_fraction", [0.0, 0.25])
def test_cosine_decay_values(end_fraction):
  lr, total, w = 2.0, 105, 5
  end = lr * end_fraction
  sched = make_schedule("cosine", lr, total_steps=total, warmup_steps=w,
                        end_lr_fraction=end_fraction)
  assert float(sched(w)) == pytest.approx(lr, rel=1e-6)
  # Quarter, half and three-quarter points of the cosine: cos(pi/4), cos(pi/2)=0, cos(3pi/4).
  quarter = end + (lr - end) * 0.5 * (1 + math.cos(math.pi / 4))
  assert float(sched(w + 25)) == pytest.approx(quarter, rel=1e-5)
  assert float(sched(w + 50)) == pytest.approx((lr + end) / 2, rel=1e-5)
  three_quarters = end + (lr - end) * 0.5 * (1 + math.cos(3 * math.pi / 4))
  assert float(sched(w + 75)) == pytest.approx(three_quarters, rel=1e-5)
  assert float(sched(total)) == pytest.approx(end, abs=1e-6)
  # Warmup multiplies the cosine (which is still at lr during warmup).
  assert float(sched(1)) == pytest.approx(lr * 2 / w, rel=1e-6)


def test_rsqrt_decays_as_inverse_square_root_of_the_step():
  lr, w = 1.0, 100
  sched = make_schedule("rsqrt", lr, total_steps=10_000, warmup_steps=w)
  # Timescale defaults to the warmup: lr * sqrt(w / (step + 1)) after warmup.
  assert float(sched(w - 1)) == pytest.approx(lr, rel=1e-6)
  assert float(sched(4 * w - 1)) == pytest.approx(lr / 2, rel=1e-6)
  assert float(sched(9 * w - 1)) == pytest.approx(lr / 3, rel=1e-6)
  assert float(sched(100 * w - 1)) == pytest.approx(lr / 10, rel=1e-6)
  # Warmup part is the linear ramp.
  assert float(sched(49)) == pytest.approx(lr * 50 / w, rel=1e-6)


def test_rsqrt_explicit_timescale_decays_from_the_end_of_warmup():
  """lr * sqrt(t / (t + steps since warmup)): the base lr right after warmup, whatever t is."""
  lr, t = 0.8, 25
  sched = make_schedule("rsqrt", lr, total_steps=10_000, timescale=t)
  for step in (0, 10, 74, 2474):
    assert float(sched(step)) == pytest.approx(lr * math.sqrt(t / (t + step + 1)), rel=1e-6)
  warm = make_schedule("rsqrt", lr, total_steps=10_000, warmup_steps=100, timescale=t)
  assert float(warm(99)) == pytest.approx(lr, rel=1e-6)  # peak is the base lr
  assert float(warm(99 + 3 * t)) == pytest.approx(lr / 2, rel=1e-6)


def test_rsqrt_cooldown_goes_linearly_to_zero_at_the_end():
  lr, w, total, cd = 1.0, 10, 1000, 100
  sched = make_schedule("rsqrt", lr, total_steps=total, warmup_steps=w, cooldown_steps=cd)
  no_cd = make_schedule("rsqrt", lr, total_steps=total, warmup_steps=w)
  # Before the cooldown, identical to the plain rsqrt.
  np.testing.assert_allclose(values(sched, [0, 5, 50, 899, 900]), values(no_cd, [0, 5, 50, 899, 900]),
                             rtol=1e-6)
  for step in [900, 925, 950, 999]:
    want = lr * math.sqrt(w / (step + 1)) * (total - step) / cd
    assert float(sched(step)) == pytest.approx(want, rel=1e-5)
  assert float(sched(total)) == 0.0
  assert float(sched(total - 1)) > 0.0


def test_schedule_is_traceable_with_an_int_array_step():
  import jax
  import jax.numpy as jnp
  sched = make_schedule("cosine", 1.0, total_steps=20, warmup_steps=4)
  got = jax.jit(sched)(jnp.asarray(12, jnp.int32))
  assert float(got) == pytest.approx(float(sched(12)), rel=1e-6)


def test_warmup_longer_than_training_is_clamped():
  sched = make_schedule("linear", 1.0, total_steps=5, warmup_steps=50)
  # warmup clamped to 5 steps: (step + 1) / 5 ramp, decay over max(0, 1) step.
  assert float(sched(0)) == pytest.approx(0.2, rel=1e-6)
  assert float(sched(4)) == pytest.approx(1.0, rel=1e-6)


def test_unknown_schedule_raises_with_valid_names():
  with pytest.raises(ValueError, match="schedule.name='exponential' is not a known schedule") as e:
    make_schedule("exponential", 1.0, total_steps=10)
  for name in SCHEDULES.names():
    assert name in str(e.value)


def _vmoe_big_vision_rsqrt(count, *, peak_value, decay_steps, timescale, warmup_steps,
                           cooldown_steps):
  """A transcription of vmoe/train/schedule.py `big_vision_rsqrt_schedule` (optax.join_schedules:
  each piece sees the count minus its start)."""
  cooldown_peak = peak_value / math.sqrt(
      1.0 + (decay_steps - warmup_steps - cooldown_steps) / timescale)
  if count < warmup_steps:
    return peak_value * count / warmup_steps
  if count < decay_steps - cooldown_steps:
    return peak_value / math.sqrt(1.0 + (count - warmup_steps) / timescale)
  return cooldown_peak * (1 - (count - (decay_steps - cooldown_steps)) / cooldown_steps)


def test_rsqrt_docstring_formula_and_vmoe_relation():
  """The formula in make_schedule's docstring, and its stated relation to vmoe's rsqrt:
  ours(step) = vmoe(step + 1) in warmup and decay; the cooldowns differ."""
  lr, w, t, total, cd = 0.5, 20, 30, 300, 50
  sched = make_schedule("rsqrt", lr, total_steps=total, warmup_steps=w, timescale=t,
                        cooldown_steps=cd)
  steps = np.arange(total)
  got = values(sched, steps)
  documented = (lr * np.minimum(1.0, (steps + 1) / w)
                * np.sqrt(t / (t + np.maximum(0, steps + 1 - w)))
                * np.clip((total - steps) / cd, 0, 1))
  np.testing.assert_allclose(got, documented, rtol=1e-6)
  vmoe = np.array([_vmoe_big_vision_rsqrt(s + 1, peak_value=lr, decay_steps=total, timescale=t,
                                          warmup_steps=w, cooldown_steps=cd) for s in steps])
  before = steps < total - cd
  np.testing.assert_allclose(got[before], vmoe[before], rtol=1e-6)
  assert not np.allclose(got[~before], vmoe[~before], rtol=1e-3)  # the documented difference
