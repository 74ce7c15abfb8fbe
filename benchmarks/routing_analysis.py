"""What the routing analysis adds to an evaluation pass, per router family.

    python -m benchmarks.routing_analysis [--models vmoe_tiny,ecmoe_tiny,softmoe_tiny] [--rounds 7]

For each model: a plain `vmoe eval` pass (the jitted prediction step, results fetched to the host
and folded into the classification statistics, batch after batch) and the same pass with the
routing analysis riding along (its device-side sums in the same step, folded on the host), on
synthetic images, in alternating rounds in one process. `overhead` = (pass with the analysis) /
(plain pass) - 1, the median of the per-round ratios; the target is at most 0.25.
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import arguments, harness
from runner.models import build_model, model_config
from runner.models.catalog import UnknownModelError
from runner.train import state as state_lib

BATCH, BATCHES, CLASSES = 128, 4, 10


def _passes(name: str):
  # runner.evaluators imports TensorFlow (it reads data): only once the arguments are good.
  from runner.evaluators import predictions, routing_analysis
  config = model_config(name)
  model = build_model(config, CLASSES)
  shape = (config.image_size, config.image_size, 3)
  params, _ = state_lib.init_params(model, shape, seed=0)
  rng = np.random.default_rng(0)
  batches = [{"image": rng.standard_normal((BATCH,) + shape).astype(np.float32),
              "labels": np.eye(CLASSES, dtype=np.float32)[rng.integers(0, CLASSES, BATCH)],
              "_mask": np.ones(BATCH, bool)} for _ in range(BATCHES)]
  plain = jax.jit(predictions.make_predict_step(model))
  info = routing_analysis.layer_info(config, BATCH)
  hook = routing_analysis.Hook({"": info}, None)
  hooked = jax.jit(predictions.make_predict_step(model, hooks={"routing_analysis": hook}))

  def run(step, with_hook: bool):
    def fn():
      stats = predictions.PredictionStats()
      for batch in batches:
        out = predictions.to_host(step(params, batch))
        out.update(labels=batch["labels"], mask=batch["_mask"])
        stats.update(out)
        if with_hook:
          hook.update(out["hooks"]["routing_analysis"], out)
      return jnp.zeros(())
    return fn
  fns = {"plain": run(plain, False), "analysis": run(hooked, True)}
  for fn in fns.values():
    fn()  # compile, warm up
  return fns, info


def measure(name: str, rounds: int) -> dict:
  fns, info = _passes(name)
  per_round = harness.interleaved_rounds_ms(fns, rounds=rounds, steps=2)
  ratios = [a / p for a, p in zip(per_round["analysis"], per_round["plain"])]
  return {"pass_ms": {k: statistics.median(v) for k, v in per_round.items()},
          "images": BATCH * BATCHES, "router": info.family,
          "overhead": statistics.median(ratios) - 1.0,
          "overhead_per_round": [r - 1.0 for r in ratios]}


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything compiles."""
  parser = arguments.Parser(prog="benchmarks.routing_analysis",
                            description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="vmoe_tiny,ecmoe_tiny,softmoe_tiny",
                      help="models with experts, as model= names them")
  parser.add_argument("--rounds", default="7", help="alternating rounds (at least 1)")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  valid = "models with experts, as model= names them (e.g. vmoe_tiny, ecmoe_tiny, softmoe_tiny)"
  models = tuple(dict.fromkeys(name for name in args.models.split(",") if name))
  if not models:
    parser.refuse(f"--models {args.models!r}: no model given; valid: {valid}")
  for name in models:
    try:
      experts = model_config(name).moe.num_experts
    except UnknownModelError:
      parser.refuse(f"--models {args.models!r}: no model {name}; valid: {valid}")
    if not experts:
      parser.refuse(f"--models {args.models!r}: {name} has no experts; valid: {valid}")
  args.models = models
  args.rounds = parser.number("--rounds", args.rounds, int, 1)
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  record = {"machine": harness.machine(), "models": {}}
  for name in args.models:
    result = measure(name, args.rounds)
    record["models"][name] = result
    ms = result["pass_ms"]
    print(f"{name} ({result['router']}): plain pass {ms['plain']:.0f} ms, with the analysis "
          f"{ms['analysis']:.0f} ms for {result['images']} images: overhead "
          f"{result['overhead']:+.1%}", flush=True)
  record["overhead"] = max(r["overhead"] for r in record["models"].values())
  print(f"written to {harness.write('routing_analysis', record, record=args.record)}")
  return record


if __name__ == "__main__":
  main()
