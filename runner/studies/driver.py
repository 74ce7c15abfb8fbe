"""What every study driver does: run real `vmoe` commands in this process, then write its table."""
from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Callable

from runner import cli


def vmoe(study: str, sub: str, args: list[str], extra: list[str]) -> None:
  """`vmoe <sub> <args> <extra>`; stops the study, naming the stage, if it fails."""
  print(f"\n=== vmoe {sub} {' '.join(args + extra)}", file=sys.stderr, flush=True)
  try:
    code = cli.main([sub] + args + extra)
  except SystemExit as e:
    code = e.code
  if code:
    raise SystemExit(f"{study}: vmoe {sub} failed (exit {code})")


def main(root: pathlib.Path, stages: Callable[[list[str]], None], table: Callable[[], str],
         extra: list[str]) -> int:
  """Runs the stages (finished ones resume or are skipped), prints the table and writes it to
  `<root>/results.md`."""
  start = time.perf_counter()
  stages(extra)
  report = table()
  (root / "results.md").write_text(report + "\n")
  print("\n" + report + f"\n\n(also in {root / 'results.md'}; "
        f"{(time.perf_counter() - start) / 60:.1f} min)")
  return 0
