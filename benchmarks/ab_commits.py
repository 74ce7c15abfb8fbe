"""The train step of this checkout against another commit's, in alternating rounds.

    python -m benchmarks.ab_commits --base <dir of the other checkout> [--presets tiny,bigger]
        [--rounds 4] [--families vmoe,experts_choice,soft]

First each checkout lowers every model's train step (benchmarks/train_step_program.py): the
same fingerprint on both sides is the same program, whatever the timings say. Two versions of
the package cannot share one process, so each round runs `benchmarks.train_step`
(one round of its own alternation) once in each checkout, the order swapped every round, on the
same Python environment; a slow minute of this shared machine then falls on both alike. Reported
per preset and model: each side's median step time over rounds and the median of the per-round
ratios this / base (< 1: this checkout is faster). Make the other checkout with
`git worktree add <dir> <commit>` or `git archive <commit> | tar -x -C <dir>`.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from benchmarks import arguments
from benchmarks.train_step import PRESETS, SPARSE

HERE = pathlib.Path(__file__).resolve().parents[1]
# Where a checkout's train_step writes its result: runs/benchmarks/ since benchmarks stopped
# rewriting tracked files, benchmarks/results/ before.
WRITTEN_TO = ("runs/benchmarks", "benchmarks/results")


def one_round(checkout: pathlib.Path, presets: str, families: str, label: str) -> dict:
  """{preset: {model: step ms}} of one train_step round run in `checkout`."""
  name = f"ab_{label}"
  started = time.time()
  subprocess.run([sys.executable, "-m", "benchmarks.train_step", "--presets", presets,
                  "--rounds", "1", "--families", families, "--name", name],
                 cwd=checkout, check=True, stdout=subprocess.DEVNULL)
  written = [checkout / folder / f"{name}.json" for folder in WRITTEN_TO]
  path = next(p for p in written if p.exists() and p.stat().st_mtime >= started)
  record = json.loads(path.read_text())
  return {preset: {model: r["train_step_ms"] for model, r in result.items()
                   if isinstance(r, dict) and "train_step_ms" in r}
          for preset, result in record["presets"].items()}


def programs(checkout: pathlib.Path, presets: str) -> dict:
  """The fingerprints of `checkout`'s lowered train steps (benchmarks/train_step_program.py);
  {} for a checkout older than that script."""
  if not (checkout / "benchmarks" / "train_step_program.py").exists():
    script = (HERE / "benchmarks" / "train_step_program.py").read_text()
    command = [sys.executable, "-c", script, "--presets", presets]
  else:
    command = [sys.executable, "-m", "benchmarks.train_step_program", "--presets", presets]
  done = subprocess.run(command, cwd=checkout, check=True, capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": str(checkout)})
  return json.loads(done.stdout.strip().splitlines()[-1])


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything runs."""
  parser = arguments.Parser(prog="benchmarks.ab_commits", description=__doc__.split("\n")[0])
  parser.add_argument("--base", required=True, help="the other checkout's folder")
  parser.add_argument("--presets", default="tiny,bigger", help=f"of {', '.join(PRESETS)}")
  parser.add_argument("--rounds", default="4", help="0: only compare the programs")
  parser.add_argument("--families", default="vmoe,experts_choice,soft",
                      help=f"of {', '.join(SPARSE)}")
  args = parser.parse_args(argv)
  args.base = parser.folder("--base", args.base, "benchmarks/train_step.py")
  args.presets = ",".join(parser.names("--presets", args.presets, "preset", list(PRESETS)))
  args.rounds = parser.number("--rounds", args.rounds, int, 0)
  args.families = ",".join(parser.names("--families", args.families, "family", SPARSE))
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  sides = {"this": HERE, "base": args.base}
  fingerprints = {side: programs(path, args.presets) for side, path in sides.items()}
  for model, digest in fingerprints["this"].items():
    same = "the same program" if fingerprints["base"].get(model) == digest else "DIFFERENT programs"
    print(f"{model}: train step lowered to {same} ({digest} / {fingerprints['base'].get(model)})")
  rounds = {side: [] for side in sides}
  for r in range(args.rounds):
    order = list(sides) if r % 2 == 0 else list(reversed(sides))
    for side in order:
      rounds[side].append(one_round(sides[side], args.presets, args.families, side))
      print(f"round {r + 1}/{args.rounds} {side}: {rounds[side][-1]}", flush=True)
  table = {"programs_identical": fingerprints["this"] == fingerprints["base"]}
  for preset, models in (rounds["this"][0] if rounds["this"] else {}).items():
    for model in models:
      this = [x[preset][model] for x in rounds["this"]]
      base = [x[preset][model] for x in rounds["base"]]
      ratios = [a / b for a, b in zip(this, base)]
      table[f"{preset}/{model}"] = dict(this_ms=statistics.median(this),
                                        base_ms=statistics.median(base),
                                        ratio=statistics.median(ratios), ratios=ratios)
      print(f"{preset}/{model}: this {statistics.median(this):.1f} ms, base "
            f"{statistics.median(base):.1f} ms, this/base {statistics.median(ratios):.3f} "
            f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")
  return table


if __name__ == "__main__":
  main()
