"""`make bench`: every benchmark, and a summary of all of them (latest.json).

Each writes its JSON to runs/benchmarks/, the summary beside them; `--record`: all of them to the
tracked benchmarks/results/ instead.
"""
from __future__ import annotations

import argparse

from benchmarks import (arguments, bpr_inference, device_scaling, dispatch_scaling, harness,
                        routing_analysis, train_step)


def parse(argv=None) -> argparse.Namespace:
  """The arguments (only --record): a bad one exits (status 2) before anything runs."""
  parser = arguments.Parser(prog="benchmarks.run_all", description=__doc__.split("\n")[0])
  harness.add_record_option(parser)
  return parser.parse_args(argv)


def main(argv=None) -> dict:
  args = parse(argv)
  record = ["--record"] if args.record else []
  steps = train_step.main(["--presets", "tiny,bigger", *record])
  latest = {
      "machine": steps["machine"],
      "matmul_peak_gflops": steps["matmul_peak_gflops"],
      "moe_overhead": steps["moe_overhead"],
      "overhead": steps["overhead"],  # per router family
      "presets": {name: {kind: result[kind] for kind in ("dense", *train_step.SPARSE)}
                  | {"moe_overhead": result["moe_overhead"],
                     "analytic_flop_ratio": result["analytic_flop_ratio"],
                     "time_ratio": result["time_ratio"]}
                  for name, result in steps["presets"].items()},
      "dispatch_scaling": dispatch_scaling.main(record)["rows"],
      "bpr_inference": bpr_inference.main(record)["rows"],
      "device_scaling": device_scaling.main(record)["runs"],
      "routing_analysis": routing_analysis.main(record)["models"],
  }
  print(f"wrote {harness.write('latest', latest, record=args.record)}")
  return latest


if __name__ == "__main__":
  main()
