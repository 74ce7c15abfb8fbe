"""Partitioned batch ensemble (E³) train step vs its V-MoE, per analytic FLOP.

`pbe_overhead` = (pBE step time / V-MoE step time) / (pBE analytic FLOPs / V-MoE analytic FLOPs):
1.0 means the ensemble costs exactly what its extra FLOPs predict (the tiled rows from the first
MoE block on, the member routers). Measured for M = 2 at the preset's k (2) and at k = 1 (the
paper's headline pBE(K=1, M=2) vs V-MoE K=1), the four models alternating round by round in one
process; the median of the per-round ratios is reported.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

from benchmarks import arguments, harness
from benchmarks.train_step import PRESETS, _prepare, model_configs
from runner.config.schema import DType
from runner.models.flops import train_flops_per_image


def _variants(preset: dict, dtype: str) -> dict:
  vmoe = model_configs(preset, dtype)["vmoe"]
  out = {}
  for k in (2, 1):
    base = dataclasses.replace(vmoe, router=dataclasses.replace(vmoe.router, k=k))
    out[f"vmoe_k{k}"] = base
    out[f"pbe_k{k}_m2"] = dataclasses.replace(base, moe=dataclasses.replace(base.moe,
                                                                            ensemble_size=2))
  return out


def measure(preset_name: str, dtype: str, rounds: int) -> dict:
  preset = PRESETS[preset_name]
  configs = _variants(preset, dtype)
  prepared = {name: _prepare(cfg, preset) for name, cfg in configs.items()}
  per_round = harness.interleaved_rounds_ms({name: p[0] for name, p in prepared.items()},
                                            rounds=rounds, steps=3)
  bs, classes = preset["batch_size"], preset["num_classes"]
  flops = {name: train_flops_per_image(cfg, classes, batch_size=bs) * bs
           for name, cfg in configs.items()}
  out = {"models": {name: {"train_step_ms": statistics.median(per_round[name]),
                           "analytic_train_flops": flops[name],
                           "xla_train_flops": prepared[name][2]} for name in configs}}
  for k in (2, 1):
    pbe, vmoe = f"pbe_k{k}_m2", f"vmoe_k{k}"
    flop_ratio = flops[pbe] / flops[vmoe]
    ratios = [p / v / flop_ratio for p, v in zip(per_round[pbe], per_round[vmoe])]
    out[f"k{k}"] = {"time_ratio": statistics.median(p / v for p, v in zip(per_round[pbe],
                                                                           per_round[vmoe])),
                    "analytic_flop_ratio": flop_ratio,
                    "xla_flop_ratio": prepared[pbe][2] / prepared[vmoe][2],
                    "pbe_overhead": statistics.median(ratios),
                    "pbe_overhead_per_round": ratios}
  return out


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything compiles."""
  parser = arguments.Parser(prog="benchmarks.pbe_step", description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="tiny", help=f"of {', '.join(PRESETS)}")
  parser.add_argument("--dtype", default="float32", help=f"of {', '.join(d.value for d in DType)}")
  parser.add_argument("--rounds", default="7", help="alternating rounds (at least 1)")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.preset = parser.choice("--preset", args.preset, list(PRESETS))
  args.dtype = parser.choice("--dtype", args.dtype, [d.value for d in DType])
  args.rounds = parser.number("--rounds", args.rounds, int, 1)
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  result = measure(args.preset, args.dtype, args.rounds)
  for name, r in result["models"].items():
    print(f"{args.preset}/{name}: {r['train_step_ms']:.1f} ms per step, analytic "
          f"{r['analytic_train_flops'] / 1e9:.2f} GFLOPs, XLA {r['xla_train_flops'] / 1e9:.2f} G")
  for k in (2, 1):
    r = result[f"k{k}"]
    print(f"pBE(k={k}, M=2) / V-MoE(k={k}): time {r['time_ratio']:.3f}, analytic FLOPs "
          f"{r['analytic_flop_ratio']:.3f} (XLA {r['xla_flop_ratio']:.3f}), pbe_overhead "
          f"{r['pbe_overhead']:.3f}", flush=True)
  record = {"machine": harness.machine(), "preset": args.preset, "dtype": args.dtype, **result}
  print(f"written to {harness.write('pbe_step', record, record=args.record)}")
  return record


if __name__ == "__main__":
  main()
