"""A `vmoe` command in a fresh process, with Python's cycle collector as `vmoe` sets it (paused
while the libraries import, their objects then frozen out of its scans: runner/command/allocator.py)
and as Python leaves it (the same command through `cli.main` from `python -c`).

    python -m benchmarks.command_start [--rounds 5] [--steps 3]

Each round runs both, alternating, in processes of their own: a tiny V-MoE pretrained `--steps`
steps (compiled programs come from a warm XLA cache, as on a researcher's second run) and a
command refused for a bad value (what a typo costs). Wall seconds per process; the medians and
each round's ratio are printed and written to results/command_start.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import harness

TINY = ["model.num_layers=2", "model.hidden_size=32", "model.mlp_dim=64", "model.num_heads=2",
        "model.image_size=16", "data.batch_size=16", "schedule.warmup_steps=0",
        "logger.wandb.mode=disabled", "logger.progress=false", "logger.report=false"]
WAYS = {  # how the process starts the command
    "vmoe (collector paused, then frozen)": ["-m", "runner.cli"],
    "Python's default collector": ["-c", "import sys; from runner import cli; "
                                         "sys.exit(cli.main(sys.argv[1:]))"],
}


def _seconds(way: list[str], args: list[str], env: dict, expect: int) -> float:
  start = time.perf_counter()
  done = subprocess.run([sys.executable, *way, *args], env=env, capture_output=True, text=True)
  seconds = time.perf_counter() - start
  if done.returncode != expect:
    raise SystemExit(f"{' '.join(args[:2])} exited {done.returncode}: {done.stderr[-2000:]}")
  return seconds


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args(argv)
  folder = tempfile.mkdtemp(prefix="vmoe-command-start-")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(folder, "xla"),
             TFDS_DATA_DIR=os.path.join(folder, "tfds"), WANDB_MODE="disabled")
  commands = {
      f"pretrain, {args.steps} steps": (
          lambda run: ["pretrain", f"workdir={folder}/{run}", f"train.steps={args.steps}",
                       *TINY], 0),
      "refused (optim.lr=-1)": (lambda run: ["pretrain", f"workdir={folder}/{run}",
                                             "optim.lr=-1", *TINY], 2),
  }
  for command, (make, expect) in commands.items():  # warm the XLA cache and the TFDS folder
    _seconds(WAYS["Python's default collector"], make("warm"), env, expect)
  seconds = {(c, w): [] for c in commands for w in WAYS}
  for r in range(args.rounds):
    for command, (make, expect) in commands.items():
      for way, start in WAYS.items():
        seconds[command, way].append(_seconds(start, make(f"{r}-{len(way)}"), env, expect))
  paused, default = WAYS
  rows = []
  for command in commands:
    a, b = seconds[command, paused], seconds[command, default]
    rows.append({"command": command, "paused_s": statistics.median(a),
                 "default_s": statistics.median(b),
                 "ratio_per_round": [x / y for x, y in zip(a, b)]})
    print(f"{command}: {statistics.median(a):.2f} s as vmoe starts it, "
          f"{statistics.median(b):.2f} s with Python's default collector "
          f"(ratio per round {', '.join(f'{x / y:.2f}' for x, y in zip(a, b))})", flush=True)
  report = {"machine": harness.machine(), "date": time.strftime("%Y-%m-%d"),
            "rounds": args.rounds, "steps": args.steps, "rows": rows}
  harness.write("command_start", report)
  return report


if __name__ == "__main__":
  main()
