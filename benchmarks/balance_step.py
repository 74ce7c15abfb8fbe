"""The train steps of `make study-balance`'s models, in alternating rounds: what each routing
option costs on this machine, measured apart from the study's runs (whose own images/s depend on
whatever else shared the cores while each ran).

    python -m benchmarks.balance_step [--rounds 5]

The study's models (runner/studies/balance.py, conf/experiment/): `vmoe_tiny` with a GAP head
(32 px, 4 blocks of 128, 8 experts on blocks 1 and 3), token-choice k = 2 with the auxiliary loss,
with loss-free bias balancing (its update in the step), with sigmoid gates, dropless; 2 shared +
2 of 16 half-width experts; experts-choice and Soft MoE (`ecmoe_tiny`, `softmoe_tiny`); each at
batch 128 with Adam. Reported: the median step time, images/s, and the median of the per-round
ratios to token-choice with the auxiliary loss. Writes runs/benchmarks/balance_step.json
(`--record`: benchmarks/results/).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from benchmarks import arguments, harness
from benchmarks.train_step import PRESETS, prepare_train_step
from runner import builtins
from runner.models import model_config, param_updates_of

BASE = "token-choice k=2, auxiliary loss"


def study_models() -> dict:
  """Row label -> the model config of the study's experiment overlay of that row."""
  builtins.register()
  tc = dataclasses.replace(model_config("vmoe_tiny"), classifier="gap")

  def router(**changes):
    return dataclasses.replace(tc, router=dataclasses.replace(tc.router, **changes))
  return {
      BASE: tc,
      "token-choice k=2, loss-free bias": router(balance="bias"),
      "token-choice k=2, sigmoid gates": router(gate="sigmoid"),
      "token-choice k=2, dropless": router(dropless=True),
      "2 shared + 2 of 16 half-width experts": dataclasses.replace(
          router(k=1), moe=dataclasses.replace(tc.moe, shared_experts=2, expert_split=2)),
      "experts-choice, C=1": model_config("ecmoe_tiny"),
      "Soft MoE, P=8": model_config("softmoe_tiny"),
  }


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything compiles."""
  parser = arguments.Parser(prog="benchmarks.balance_step", description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", default="5", help="alternating rounds (at least 1)")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.rounds = parser.number("--rounds", args.rounds, int, 1)
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  preset = PRESETS["tiny"]
  steps = {name: prepare_train_step(config, preset, param_updates=param_updates_of(
      config, "pretrain")) for name, config in study_models().items()}
  per_round = harness.interleaved_rounds_ms({n: s.run for n, s in steps.items()},
                                            rounds=args.rounds, steps=3)
  batch = preset["batch_size"]
  rows = []
  print("| model | step ms | images/s | time / token-choice k=2 (aux loss) | XLA GFLOPs/step |\n"
        "|---|---|---|---|---|")
  for name, step in steps.items():
    ratios = [t / b for t, b in zip(per_round[name], per_round[BASE])]
    ms = statistics.median(per_round[name])
    rows.append({"model": name, "train_step_ms": ms, "images_per_s": batch / ms * 1e3,
                 "time_ratio": statistics.median(ratios), "time_ratio_per_round": ratios,
                 "xla_train_flops": step.xla_flops, "compile_s": step.compile_s})
    print(f"| {name} | {ms:.0f} | {batch / ms * 1e3:.0f} | {statistics.median(ratios):.2f} | "
          f"{step.xla_flops / 1e9:.1f} |", flush=True)
  record = {"machine": harness.machine(), "date": time.strftime("%Y-%m-%d"),
            "rounds": args.rounds, "batch_size": batch, "rows": rows}
  print(f"written to {harness.write('balance_step', record, record=args.record)}")
  return record


if __name__ == "__main__":
  main()
