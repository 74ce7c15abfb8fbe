"""A `vmoe` command in a fresh process as `vmoe` starts it, and two ways that each undo one of the
things it does to start sooner: with Python's cycle collector as Python leaves it (the same
command through `cli.main` from `python -c`; `vmoe` pauses it while the libraries import and then
freezes their objects out of its scans: runner/command/allocator.py), and with TensorFlow
importing Keras 3 as it loads (TF_USE_LEGACY_KERAS=0; runner/data/__init__.py stops it).

    python -m benchmarks.command_start [--rounds 5] [--steps 3] [--base <dir>]

`--base` adds a fourth: `vmoe` as another checkout (`git worktree add <dir> <commit>`) starts
it, on the same Python environment, for a change measured before and after. Each round runs
them, alternating, in processes of their own: a tiny V-MoE pretrained `--steps` steps (compiled
programs come from a warm XLA cache, as on a researcher's second run), a command refused for a
bad value (what a typo costs), one refused for a TFDS dataset not prepared here and a stage's
help page. Wall seconds per process; the medians and each round's ratio to `vmoe`'s own start
are printed and written to runs/benchmarks/command_start.json (`--record`: benchmarks/results/).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import arguments, harness

TINY = ["model.num_layers=2", "model.hidden_size=32", "model.mlp_dim=64", "model.num_heads=2",
        "model.image_size=16", "data.batch_size=16", "schedule.warmup_steps=0",
        "logger.wandb.mode=disabled", "logger.progress=false", "logger.report=false"]
VMOE = "as vmoe starts it"
WAYS = {  # how the process starts the command, what it changes in the environment, and where
    VMOE: (["-m", "runner.cli"], {}, None),  # (`python -m` imports the package of that folder)
    "Python's default collector": (["-c", "import sys; from runner import cli; "
                                          "sys.exit(cli.main(sys.argv[1:]))"], {}, None),
    "TensorFlow importing Keras": (["-m", "runner.cli"], {"TF_USE_LEGACY_KERAS": "0"}, None),
}


def _seconds(way: tuple[list[str], dict, str | None], args: list[str], env: dict,
             expect: int) -> float:
  start_args, changes, checkout = way
  start = time.perf_counter()
  done = subprocess.run([sys.executable, *start_args, *args], env={**env, **changes},
                        cwd=checkout, capture_output=True, text=True)
  seconds = time.perf_counter() - start
  if done.returncode != expect:
    raise SystemExit(f"{' '.join(args[:2])} exited {done.returncode}: {done.stderr[-2000:]}")
  return seconds


def parse(argv: list[str] | None = None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before any process starts."""
  parser = arguments.Parser(prog="benchmarks.command_start",
                            description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", default="5", help="alternating rounds (at least 1)")
  parser.add_argument("--steps", default="3", help="pretrain steps (at least 1)")
  parser.add_argument("--base", help="another checkout of vmoe, started as a fourth way")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.rounds = parser.number("--rounds", args.rounds, int, 1)
  args.steps = parser.number("--steps", args.steps, int, 1)
  if args.base and not os.path.isfile(os.path.join(args.base, "runner", "cli.py")):
    parser.refuse(f"--base {args.base!r}: valid: a checkout of vmoe (a folder with runner/cli.py)")
  return args


def main(argv: list[str] | None = None) -> dict:
  args = parse(argv)
  ways = dict(WAYS)
  if args.base:
    ways[f"the checkout {args.base}"] = (["-m", "runner.cli"], {}, os.path.abspath(args.base))
  folder = tempfile.mkdtemp(prefix="vmoe-command-start-")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(folder, "xla"),
             TFDS_DATA_DIR=os.path.join(folder, "tfds"), WANDB_MODE="disabled")
  commands = {
      f"pretrain, {args.steps} steps": (
          lambda run: ["pretrain", f"workdir={folder}/{run}", f"train.steps={args.steps}",
                       *TINY], 0),
      "refused (optim.lr=-1)": (lambda run: ["pretrain", f"workdir={folder}/{run}",
                                             "optim.lr=-1", *TINY], 2),
      "refused (data=cifar10 not prepared)": (lambda run: ["pretrain", f"workdir={folder}/{run}",
                                                           "data=cifar10", *TINY], 2),
      "pretrain --help": (lambda run: ["pretrain", "--help"], 0),
  }
  for command, (make, expect) in commands.items():  # warm the XLA cache and the TFDS folder
    _seconds(WAYS[VMOE], make("warm"), env, expect)
  seconds = {(c, w): [] for c in commands for w in ways}
  for r in range(args.rounds):
    for command, (make, expect) in commands.items():
      for n, (way, start) in enumerate(ways.items()):
        seconds[command, way].append(_seconds(start, make(f"{r}-{n}"), env, expect))
  rows = []
  for command in commands:
    own = seconds[command, VMOE]
    row = {"command": command, "seconds": {w: statistics.median(seconds[command, w]) for w in ways},
           "ratio_per_round": {w: [x / y for x, y in zip(own, seconds[command, w])]
                               for w in ways if w != VMOE}}
    rows.append(row)
    parts = [f"{row['seconds'][VMOE]:.2f} s {VMOE}"]
    for way, ratios in row["ratio_per_round"].items():
      parts.append(f"{row['seconds'][way]:.2f} s {way} (vmoe's / this, per round: "
                   f"{', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"{command}: " + "; ".join(parts), flush=True)
  report = {"machine": harness.machine(), "date": time.strftime("%Y-%m-%d"),
            "rounds": args.rounds, "steps": args.steps, "rows": rows}
  harness.write("command_start", report, record=args.record)
  return report


if __name__ == "__main__":
  main()
