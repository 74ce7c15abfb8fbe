"""A fingerprint of each train_step preset's lowered train step (StableHLO, source locations left
out), so two commits can be shown to compile the same program for it.

    python -m benchmarks.train_step_program [--presets tiny,bigger]

Identical fingerprints mean identical programs, hence the same speed, whatever a noisy machine's
timings say; `benchmarks.ab_commits` prints them for both checkouts next to the timings.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re

import jax
import jax.numpy as jnp

from benchmarks.train_step import PRESETS, model_configs
try:
  from benchmarks import arguments
except ImportError:  # run as a script by ab_commits in a checkout older than benchmarks/arguments
  arguments = None
from runner.models import build_model
from runner.train import optimizers, schedules, state as state_lib
from runner.train.step import make_train_step

_LOCATIONS = re.compile(r"loc\(.*?\)|#loc\d*( = .*)?")


def fingerprints(presets: list[str], dtype: str = "float32") -> dict:
  """{"<preset>/<model>": sha256 prefix of the lowered train step's text}."""
  out = {}
  for name in presets:
    preset = PRESETS[name]
    shape = (preset["image_size"], preset["image_size"], 3)
    batch_size, classes = preset["batch_size"], preset["num_classes"]
    for kind, config in model_configs(preset, dtype).items():
      model = build_model(config, classes)
      params, _ = state_lib.init_params(model, shape, seed=0)
      schedule = schedules.make_schedule("linear", 1e-3, 10_000, 100)
      tx = optimizers.make_optimizer("adam", schedule, params, grad_clip_norm=1.0)
      state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                   opt_state=tx.init(params))
      batch = {"image": jnp.zeros((batch_size,) + shape),
               "labels": jnp.zeros((batch_size, classes))}
      step = make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01)
      text = _LOCATIONS.sub("", jax.jit(step).lower(state, batch).as_text())
      out[f"{name}/{kind}"] = hashlib.sha256(text.encode()).hexdigest()[:16]
  return out


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything is lowered."""
  if arguments is None:  # ab_commits checked them against its own checkout's presets
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="tiny,bigger")
    args = parser.parse_args(argv)
    args.presets = args.presets.split(",")
    return args
  parser = arguments.Parser(prog="benchmarks.train_step_program",
                            description=__doc__.split("\n")[0])
  parser.add_argument("--presets", default="tiny,bigger", help=f"of {', '.join(PRESETS)}")
  args = parser.parse_args(argv)
  args.presets = list(parser.names("--presets", args.presets, "preset", list(PRESETS)))
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  result = fingerprints(args.presets)
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
