"""Inference time per image with Batch Prioritized Routing as the capacity ratio shrinks.

    python -m benchmarks.bpr_inference [--preset tiny] [--ratios 1.05,0.5,0.25,0.1]

The V-MoE of a `train_step` preset, evaluated (forward only, train=False) on a batch of synthetic
images with BPR at each inference capacity ratio C; the experts' work is proportional to C, so
time per image should fall with it. Also reports the analytic forward FLOPs per image.
"""
from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import arguments, harness
from benchmarks.train_step import PRESETS, model_configs
from runner.models import build_model
from runner.models.flops import forward_flops_per_image
from runner.train import state as state_lib
from runner.train.step import make_eval_step


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything compiles."""
  parser = arguments.Parser(prog="benchmarks.bpr_inference", description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="tiny", help=f"of {', '.join(PRESETS)}")
  parser.add_argument("--ratios", default="1.05,0.5,0.25,0.1",
                      help="inference capacity ratios C, each > 0")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.preset = parser.choice("--preset", args.preset, list(PRESETS))
  args.ratios = parser.numbers("--ratios", args.ratios, float, 0, low_open=True)
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  preset = PRESETS[args.preset]
  bs, shape = preset["batch_size"], (preset["image_size"],) * 2 + (3,)
  base = model_configs(preset, "float32")["vmoe"]
  rng = np.random.default_rng(0)
  batch = {"image": jnp.asarray(rng.standard_normal((bs,) + shape), jnp.float32),
           "labels": jax.nn.one_hot(rng.integers(0, preset["num_classes"], bs),
                                    preset["num_classes"]),
           "_mask": jnp.ones((bs,), bool)}
  params = None
  steps, rows = {}, []
  for ratio in args.ratios:
    config = dataclasses.replace(base, router=dataclasses.replace(
        base.router, eval_capacity_ratio=ratio, batch_priority=True))
    model = build_model(config, preset["num_classes"])
    if params is None:  # the same parameters at every ratio: only inference routing changes
      params, _ = state_lib.init_params(model, shape, seed=0)
    step = jax.jit(make_eval_step(model))
    jax.block_until_ready(step(params, batch))
    steps[ratio] = lambda step=step: step(params, batch)["count"]
  times = harness.interleaved_median_ms(steps, rounds=5, steps=3)
  for ratio, ms in times.items():
    config = dataclasses.replace(base, router=dataclasses.replace(base.router,
                                                                  eval_capacity_ratio=ratio))
    row = {"capacity_ratio": ratio, "ms_per_batch": ms, "ms_per_image": ms / bs,
           "images_per_s": bs / ms * 1e3,
           "analytic_forward_gflops_per_image": forward_flops_per_image(
               config, preset["num_classes"], batch_size=bs, train=False) / 1e9}
    rows.append(row)
    print(f"C={ratio:<5}: {row['ms_per_image']:.3f} ms/image ({row['images_per_s']:.0f} img/s), "
          f"{row['analytic_forward_gflops_per_image']:.4f} GFLOPs/image", flush=True)
  record = {"machine": harness.machine(), "preset": args.preset, "batch_size": bs, "rows": rows}
  print(f"written to {harness.write('bpr_inference', record, record=args.record)}")
  return record


if __name__ == "__main__":
  main()
