"""`make bench`: every benchmark; a summary of all of them in benchmarks/results/latest.json."""
from __future__ import annotations

from benchmarks import (bpr_inference, device_scaling, dispatch_scaling, harness,
                        routing_analysis, train_step)


def main() -> dict:
  steps = train_step.main(["--presets", "tiny,bigger"])
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
      "dispatch_scaling": dispatch_scaling.main([])["rows"],
      "bpr_inference": bpr_inference.main([])["rows"],
      "device_scaling": device_scaling.main([])["runs"],
      "routing_analysis": routing_analysis.main([])["models"],
  }
  print(f"wrote {harness.write('latest', latest)}")
  return latest


if __name__ == "__main__":
  main()
