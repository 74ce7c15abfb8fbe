"""V-MoE train steps on one accelerator, against the device's own matmul peaks.

    make bench-gpu            # PYTHONPATH=. python -m benchmarks.gpu
    python -m benchmarks.gpu [--small] [--budget-s 400] [--models s32,b16]
                             [--dtypes bfloat16,float32] [--rounds 5] [--output-dir DIR]
                             [--families vmoe,experts_choice,soft,dropless]

V-MoE-S/32 (`train_step`'s `s32` preset: 32 experts on blocks 5 and 7) and V-MoE-B/16 (`b16`: 32
experts on every second block), batch 256 at 224 px, each as token-choice (k = 2, C = 1.05),
experts-choice, Soft MoE and the dense twin (`train_step.model_configs`), in bfloat16
(`model.dtype=bfloat16`: float32 parameters) and float32. Per model: compile seconds, the median
step time over rounds in which it alternates with its dense twin, images/s, MFU (analytic FLOPs
over the matmul peak of its dtype, measured first), and a sparse model's overhead over the dense
twin (`train_step.overhead`). Each sparse model is compiled, timed and freed in turn beside the
dense twin, so at most two models' parameters and Adam states are on the device at once.
`--families` chooses the sparse models; `dropless` (token-choice with model.router.dropless=true,
k = 2: the experts as `jax.lax.ragged_dot` grouped matmuls) is measured only when named, as XLA
may lower ragged_dot to a dense product over every expert (E times the experts' FLOPs, and the
time and memory that go with it).

It imports jax, flax, optax, numpy and vmoe's source only: no TensorFlow, TFDS, Hydra, OmegaConf
or W&B, so a CUDA JAX image runs it as it is. Before each model it checks the time budget
(`--budget-s`, from the start: the default fits 8 minutes on one GPU) against the longest a
model of its size took so far, and skips what would not fit, saying so; whatever was measured is
written, always, to results/gpu.json (results/gpu_small.json with `--small`) and printed as a
table. A model that fails (out of memory, say) is reported as an error, the others still run,
and the exit status is 1. `--small` runs the same code on tiny shapes, compiled with XLA's
fast-compile options (SMALL_XLA_FLAGS): about a minute on a CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.train_step import (PRESETS, SPARSE, TrainStep, model_configs, overhead,
                                   prepare_train_step)
from runner.config.schema import ModelConfig
from runner.models.flops import train_flops_per_image

MODELS = {"s32": PRESETS["s32"], "b16": PRESETS["b16"]}
# The same code on shapes a CPU runs in about a minute: the two models' structure (experts on the
# last block; on every second block), not their size.
SMALL_MODELS = {
    "s32": dict(image_size=32, patch_size=8, hidden_size=32, num_layers=2, mlp_dim=64,
                num_heads=2, num_classes=10, batch_size=16, num_experts=4, moe_layers=[1]),
    "b16": dict(image_size=32, patch_size=4, hidden_size=32, num_layers=4, mlp_dim=64,
                num_heads=2, num_classes=10, batch_size=16, num_experts=4, moe_layers=[1, 3]),
}
FAMILY_NAMES = {"dense": "dense", "vmoe": "token-choice", "experts_choice": "experts-choice",
                "soft": "Soft MoE", "dropless": "token-choice dropless"}
# A model larger than any measured so far is guessed to take this many times the longest.
UNSEEN_SIZE_FACTOR = 3.0
# --small compiles 16 tiny programs and runs each for a few steps: XLA's backend optimisation,
# CPU fusion emitters and parallel code generation cost more than they save there (half the run;
# tests/conftest.py sets the same). The functions computed are the same; the flags are in the
# result's machine.xla_flags.
SMALL_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                   "--xla_cpu_parallel_codegen_split_count=1")


def with_auto_attention(config: ModelConfig) -> tuple[ModelConfig, str | None]:
  """`model.attention=auto` (the implementation best for the device) where the schema has that
  key, and the value recorded; the config unchanged and None where it has not."""
  if "attention" not in {f.name for f in dataclasses.fields(ModelConfig)}:
    return config, None
  value = config.attention
  if str(getattr(value, "value", value)) != "auto":
    config = dataclasses.replace(config, attention=type(value)("auto"))
  return config, "auto"


class Budget:
  """Seconds from the start; a model runs only if the longest one of its size took fits."""

  def __init__(self, seconds: float):
    self.end = time.monotonic() + seconds
    self.longest: dict[str, float] = {}

  def expected(self, size: str) -> float:
    if size in self.longest:
      return self.longest[size]
    return UNSEEN_SIZE_FACTOR * max(self.longest.values(), default=0.0)

  def allows(self, size: str) -> bool:
    return time.monotonic() + self.expected(size) <= self.end

  def left(self) -> float:
    return self.end - time.monotonic()

  def spent(self, size: str, seconds: float) -> None:
    self.longest[size] = max(self.longest.get(size, 0.0), seconds)


def _error(exc: Exception) -> str:
  return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def _configs(preset: dict, dtype: str) -> dict[str, ModelConfig]:
  """`train_step.model_configs`, and "dropless": its token-choice V-MoE routing dropless."""
  configs = model_configs(preset, dtype)
  vmoe = configs["vmoe"]
  configs["dropless"] = dataclasses.replace(vmoe, router=dataclasses.replace(vmoe.router,
                                                                             dropless=True))
  return configs


def measure_group(size: str, preset: dict, dtype: str, peak_gflops: float, budget: Budget,
                  report: dict, *, rounds: int, steps: int,
                  families: tuple[str, ...] = SPARSE) -> list[dict]:
  """The rows of the dense twin and of each sparse family timed beside it; skips and errors go
  into `report`."""
  configs = {}
  for kind, config in _configs(preset, dtype).items():
    if kind in families + ("dense",):
      configs[kind], report["attention"] = with_auto_attention(config)
  batch = preset["batch_size"]
  flops = {kind: train_flops_per_image(config, preset["num_classes"], batch_size=batch) * batch
           for kind, config in configs.items()}

  def prepare(kind: str) -> TrainStep | None:
    name = f"{size}/{dtype}/{kind}"
    if not budget.allows(size):
      print(f"{name}: skipped: {budget.left():.0f} s of the budget left, and a {size} model "
            f"takes about {budget.expected(size):.0f} s (--budget-s)", flush=True)
      report["skipped"].append(name)
      return None
    try:
      return prepare_train_step(configs[kind], preset)
    except Exception as e:  # noqa: BLE001 -- out of memory, say: the other models still run
      report["errors"].append(f"{name}: {_error(e)}")
      print(f"{name}: failed: {_error(e)}", flush=True)
      return None

  def row(kind: str, step: TrainStep, rounds_ms: list) -> dict:
    step_ms = statistics.median(rounds_ms)
    return {"model": size, "dtype": dtype, "family": kind, "attention": report["attention"],
            "batch_size": batch, "compile_s": step.compile_s, "train_step_ms": step_ms,
            "train_step_ms_per_round": rounds_ms, "images_per_s": batch / step_ms * 1e3,
            "analytic_train_flops": flops[kind], "xla_train_flops": step.xla_flops,
            "mfu": flops[kind] / (step_ms / 1e3) / (peak_gflops * 1e9),
            "parameters": step.num_params}

  start = time.monotonic()
  dense = prepare("dense")
  if dense is None:  # skipped or failed: its sparse models would have nothing to compare with
    report["skipped"] += [f"{size}/{dtype}/{kind}" for kind in families]
    return []
  budget.spent(size, time.monotonic() - start)
  dense_flops = {"analytic_train_flops": flops["dense"], "xla_train_flops": dense.xla_flops}
  dense_rounds, sparse_rows = [], []
  for kind in families:
    start = time.monotonic()
    sparse = prepare(kind)
    if sparse is None:
      continue
    try:
      times = harness.interleaved_rounds_ms({"dense": dense.run, kind: sparse.run},
                                            rounds=rounds, steps=steps)
      dense_rounds += times["dense"]
      sparse_row = row(kind, sparse, times[kind])
      sparse_row.update(overhead(times[kind], times["dense"], sparse_row, dense_flops))
      sparse_rows.append(sparse_row)
    except Exception as e:  # noqa: BLE001 -- as in prepare
      report["errors"].append(f"{size}/{dtype}/{kind}: {_error(e)}")
      print(f"{size}/{dtype}/{kind}: failed: {_error(e)}", flush=True)
    finally:
      budget.spent(size, time.monotonic() - start)
      del sparse  # its parameters and Adam state leave the device before the next family's
      gc.collect()
  if not dense_rounds:  # every sparse family skipped or failed: the dense twin alone
    dense_rounds = harness.interleaved_rounds_ms({"dense": dense.run}, rounds=rounds,
                                                 steps=steps)["dense"]
  return [row("dense", dense, dense_rounds), *sparse_rows]


def _table(rows: list) -> str:
  lines = ["| model | family | dtype | compile s | step ms | images/s | MFU | time ratio | "
           "FLOP ratio | overhead |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    ratios = (f"{r['time_ratio']:.3f} | {r['analytic_flop_ratio']:.3f} | **{r['overhead']:.3f}**"
              if "overhead" in r else "1 | 1 | -")
    lines.append(f"| {r['model']} | {FAMILY_NAMES[r['family']]} | {r['dtype']} | "
                 f"{r['compile_s']:.1f} | {r['train_step_ms']:.1f} | {r['images_per_s']:,.0f} | "
                 f"{r['mfu']:.1%} | {ratios} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  started = time.monotonic()
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true",
                      help="tiny shapes, few rounds: the same code on a CPU in about a minute")
  parser.add_argument("--budget-s", type=float, default=400.0,
                      help="seconds from the start; models that would not fit are skipped")
  parser.add_argument("--models", default="s32,b16")
  parser.add_argument("--dtypes", default="bfloat16,float32")
  parser.add_argument("--rounds", type=int, help="alternating rounds (default 5; --small 2)")
  parser.add_argument("--steps", type=int, help="steps per round (default 3; --small 2)")
  parser.add_argument("--output-dir", type=pathlib.Path, default=harness.RESULTS)
  parser.add_argument("--families", default=",".join(SPARSE),
                      help="sparse models beside the dense twin: vmoe (token-choice), "
                           "experts_choice, soft, dropless (token-choice dropless)")
  args = parser.parse_args(argv)
  rounds = args.rounds or (2 if args.small else 5)
  steps = args.steps or (2 if args.small else 3)
  families = tuple(f for f in args.families.split(",") if f)
  unknown = sorted(set(families) - set(FAMILY_NAMES) - {"dense"})
  if unknown:
    valid = ", ".join(k for k in FAMILY_NAMES if k != "dense")
    parser.error(f"unknown --families {unknown}; valid: {valid}")
  flags = os.environ.get("XLA_FLAGS", "")
  if args.small and SMALL_XLA_FLAGS not in flags:  # read when JAX starts its backend, just below
    os.environ["XLA_FLAGS"] = f"{flags} {SMALL_XLA_FLAGS}".strip()
  print(f"devices: {jax.devices()}", flush=True)
  if jax.default_backend() == "cpu" and not args.small:
    print("no accelerator: JAX sees the CPU only (a CPU build of jaxlib?); the full-size models "
          "run until the budget is spent. --small is the CPU run.", flush=True)
  budget = Budget(args.budget_s - (time.monotonic() - started))
  models = SMALL_MODELS if args.small else MODELS
  dtypes = [d for d in args.dtypes.split(",") if d]
  # A matmul the size of the device's (2048^3 would leave a GPU mostly waiting on the launch).
  matmul_n = 256 if args.small else 8192
  peaks = {d: harness.matmul_peak_gflops(matmul_n, jnp.dtype(d)) for d in dtypes}
  print("matmul peak: " + ", ".join(f"{d} {g:,.0f} GFLOP/s" for d, g in peaks.items()),
        flush=True)
  report = {"machine": harness.machine(), "devices": [str(d) for d in jax.devices()],
            "date": time.strftime("%Y-%m-%d"), "small": args.small,
            "matmul_peak_gflops": peaks, "matmul_n": matmul_n,
            "matmul_precision": str(jax.config.jax_default_matmul_precision),
            "rounds": rounds, "steps_per_round": steps, "budget_s": args.budget_s,
            "presets": {m: models[m] for m in args.models.split(",")}, "attention": None,
            "families": list(families), "rows": [], "skipped": [], "errors": []}
  for dtype in dtypes:  # bfloat16 first: on an accelerator it matters most
    for size in args.models.split(","):
      rows = measure_group(size, models[size], dtype, peaks[dtype], budget, report,
                           rounds=rounds, steps=steps, families=families)
      report["rows"] += rows
      for r in rows:
        print(f"{size}/{dtype}/{r['family']}: compile {r['compile_s']:.1f} s, "
              f"{r['train_step_ms']:.1f} ms per step, {r['images_per_s']:,.0f} img/s, "
              f"MFU {r['mfu']:.1%}", flush=True)
  report["elapsed_s"] = time.monotonic() - started
  path = harness.write("gpu_small" if args.small else "gpu", report, args.output_dir)
  print(_table(report["rows"]))
  for line in report["skipped"]:
    print(f"skipped (budget): {line}")
  for line in report["errors"]:
    print(f"error: {line}")
  print(f"{report['elapsed_s']:.0f} s; written to {path}")
  return report


if __name__ == "__main__":
  sys.exit(1 if main()["errors"] else 0)
