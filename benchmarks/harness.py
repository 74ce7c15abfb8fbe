"""Measurement helpers shared by the benchmarks: machine description, matmul peak, fair timing,
and where results go.

A run's results go to runs/benchmarks/ under the checkout (git ignores runs/), so running a
benchmark leaves the checkout clean; the tracked records in benchmarks/results/, which the docs
cite, are written only when asked: `add_record_option(parser)` gives a script `--record`, and
`write(name, result, record=args.record)` honours it.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"  # tracked: written with --record
RUNS = pathlib.Path(__file__).resolve().parents[1] / "runs" / "benchmarks"  # ignored by git


def machine() -> dict:
  cpu = platform.processor()
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  device = jax.devices()[0]
  return {"cpu": cpu, "cpu_count": os.cpu_count(), "jax": jax.__version__,
          "backend": jax.default_backend(), "device": getattr(device, "device_kind", str(device)),
          "device_count": jax.device_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def matmul_peak_gflops(n: int = 2048, dtype=jnp.float32, reps: int = 10) -> float:
  """Best sustained GFLOP/s of one n^3 matmul: the denominator of model FLOPs utilisation."""
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / min(times) / 1e9


def interleaved_rounds_ms(fns: dict, *, rounds: int = 5, steps: int = 4) -> dict:
  """Per round, the median milliseconds per call of each zero-argument function. Candidates
  alternate round by round so that slow drifts of a shared machine affect all of them alike,
  and ratios between candidates are best taken round by round."""
  per_round = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      times = []
      for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
      per_round[name].append(statistics.median(times))
  return per_round


def interleaved_median_ms(fns: dict, *, rounds: int = 5, steps: int = 4) -> dict:
  """Median over rounds of `interleaved_rounds_ms`."""
  return {name: statistics.median(v)
          for name, v in interleaved_rounds_ms(fns, rounds=rounds, steps=steps).items()}


def add_record_option(parser: argparse.ArgumentParser) -> None:
  """`--record`: the run replaces the tracked record in benchmarks/results/ (what `write` takes
  as `record`)."""
  parser.add_argument("--record", action="store_true",
                      help="write the result to the tracked benchmarks/results/<name>.json "
                           "instead of runs/benchmarks/<name>.json")


def write(name: str, result: dict, directory: pathlib.Path | None = None, *,
          record: bool = False) -> pathlib.Path:
  """`result` as <name>.json in `directory` if given, else in the tracked benchmarks/results/ when
  `record`, else in runs/benchmarks/ (wherever the command runs from); the path written."""
  directory = pathlib.Path(directory or (RESULTS if record else RUNS))
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / f"{name}.json"
  path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
  return path
