"""`vmoe summarize`: the sweep's table (runner.report.summarize), then its `vmoe report` page, so
a finished sweep has its page without asking (`--no-report` skips it); like `vmoe report`, only
pages vmoe wrote are replaced (the table is printed all the same)."""
from __future__ import annotations

import pathlib
import sys

from runner.report import run_page, summarize, sweep_page


def main(argv: list[str]) -> int:
  code = summarize.main(argv)
  args = summarize.arguments().parse_args(argv)
  if code or args.no_report or not sweep_page.is_sweep(pathlib.Path(args.directory)):
    return code
  try:
    page = sweep_page.write_sweep_page(args.directory)[-1]
  except run_page.PathTaken as e:  # a page replaces only a page: trying again would not help
    print(f"vmoe summarize: warning: the sweep's pages were not written: {e}", file=sys.stderr)
    return code
  except Exception as e:  # noqa: BLE001 (the table is written: a page is extra)
    print(f"vmoe summarize: warning: the sweep's report.html was not written "
          f"({type(e).__name__}: {e}); `vmoe report {args.directory}` tries again.",
          file=sys.stderr)
    return code
  print(f"(the sweep's page, each job's linked: {page})")
  return code
