"""Measurement helpers shared by the benchmarks: machine description, matmul peak, fair timing."""
from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"


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


def interleaved_median_ms(fns: dict, *, rounds: int = 5, steps: int = 4) -> dict:
  """Median milliseconds per call of each zero-argument function, measured in alternating rounds
  so that slow drifts of a shared machine affect every candidate alike."""
  samples = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples[name].append((time.perf_counter() - start) * 1e3)
  return {name: statistics.median(v) for name, v in samples.items()}


def write(name: str, record: dict) -> pathlib.Path:
  RESULTS.mkdir(parents=True, exist_ok=True)
  path = RESULTS / f"{name}.json"
  path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
  return path
