"""`vmoe summarize`: the sweep's table (runner.summarize), then its `vmoe report` page refreshed,
so that the page of a finished sweep is there without asking (`--no-report` skips it)."""
from __future__ import annotations

import pathlib
import sys

from runner import summarize
from runner.report import sweep_page


def main(argv: list[str]) -> int:
  code = summarize.main(argv)
  args = summarize.arguments().parse_args(argv)
  if code or args.no_report or not sweep_page.is_sweep(pathlib.Path(args.directory)):
    return code
  try:
    page = sweep_page.write_sweep_page(args.directory)[-1]
  except Exception as e:  # noqa: BLE001 (the table is written: a page is extra)
    print(f"vmoe summarize: warning: the sweep's report.html was not written "
          f"({type(e).__name__}: {e}); `vmoe report {args.directory}` tries again.",
          file=sys.stderr)
    return code
  print(f"(the sweep's page, each job's linked: {page})")
  return code
