"""`make bench`: every benchmark, results merged into benchmarks/results/latest.json."""
from __future__ import annotations

import json

from benchmarks import harness, train_step


def main() -> dict:
  steps = train_step.main(["--presets", "tiny,bigger", "--name", "train_step"])
  latest = {
      "machine": steps["machine"],
      "matmul_peak_gflops": steps["matmul_peak_gflops"],
      "moe_overhead": steps["moe_overhead"],
      "presets": {name: {kind: result[kind] for kind in ("vmoe", "dense")}
                  | {"moe_overhead": result["moe_overhead"],
                     "analytic_flop_ratio": result["analytic_flop_ratio"],
                     "time_ratio": result["time_ratio"]}
                  for name, result in steps["presets"].items()},
  }
  path = harness.write("latest", latest)
  print(f"wrote {path}")
  return latest


if __name__ == "__main__":
  main()
