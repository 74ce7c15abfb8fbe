"""`vmoe report PATH... [--out FILE]`: write the HTML page of each run or sweep named.

Every path is checked before anything is written: a mistake, or a page's path that holds
anything but a page vmoe wrote, writes nothing and is one paragraph on stderr and exit code 2."""
from __future__ import annotations

import argparse
import pathlib
import sys

from runner.report import chain_page, run_page, sweep_page, workdir

WHAT_IS_VALID = ("Give a run's workdir (a folder holding summary.json or metrics.jsonl, e.g. "
                 "runs/up after `vmoe pretrain workdir=runs/up`), a folder of such runs (a chain "
                 "of stages, e.g. runs/demo) or a sweep's folder (numbered job folders, each a "
                 "workdir with its summary.json, as `--multirun` writes them).")


class NotReportable(ValueError):
  """A path that is neither a run nor a sweep; the message is the paragraph to print."""


def kind(path: pathlib.Path) -> str:
  """"run", "chain" (named runs below) or "sweep" (numbered jobs below), else NotReportable."""
  if not path.exists():
    raise NotReportable(f"{path} does not exist. {WHAT_IS_VALID}")
  if not path.is_dir():
    raise NotReportable(f"{path} is a file, not a folder. {WHAT_IS_VALID}")
  if workdir.is_run(path):
    return "run"
  if chain_page.is_chain(path):
    return "chain"
  if sweep_page.is_sweep(path):
    return "sweep"
  if any(child.is_dir() and workdir.is_run(child) for child in path.iterdir()):
    raise NotReportable(f"{path} holds job folders but none has finished (no summary.json "
                        "below it); `vmoe report <job folder>` shows a running job. "
                        + WHAT_IS_VALID)
  what = "an empty folder" if not any(path.iterdir()) else "a folder with no run and no sweep in it"
  raise NotReportable(f"{path} is {what}. {WHAT_IS_VALID}")


# The pages each kind of path gets written, in the order they are written; what writes them.
_PAGES = {"run": lambda folder, out: [run_page.page_path(folder, out)],
          "chain": chain_page.pages, "sweep": sweep_page.pages}
_WRITE = {"run": lambda folder, out: [run_page.write_run_page(folder, out)],
          "chain": chain_page.write_chain_page, "sweep": sweep_page.write_sweep_page}


def report(paths: list[str], out: str | None = None) -> list[pathlib.Path]:
  """Writes the page of every path (run or sweep); returns the pages written."""
  folders = [pathlib.Path(p) for p in paths]
  if out and len(folders) != 1:
    raise NotReportable(f"--out names one page, and {len(folders)} paths were given; give "
                        "one path with --out, or leave --out out to write each page into its "
                        "folder.")
  kinds = [kind(folder) for folder in folders]  # all checked before anything is written
  for folder, what in zip(folders, kinds):
    run_page.check_replaceable(_PAGES[what](folder, out), out)
  return [page for folder, what in zip(folders, kinds) for page in _WRITE[what](folder, out)]


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(
      prog="vmoe report", description="One self-contained offline HTML page per run or sweep: "
      "<run>/report.html, or <sweep>/report.html and a page per job (docs/report.md).")
  parser.add_argument("paths", nargs="+", metavar="PATH", help="a run's workdir or a sweep's "
                      "folder")
  parser.add_argument("--out", metavar="FILE", help="where to write the page: a new file or "
                      "an earlier page, never any other file (one PATH only; default: "
                      "PATH/report.html)")
  args = parser.parse_args(argv)
  try:
    pages = report(args.paths, args.out)
  except (NotReportable, run_page.PathTaken) as e:
    print(f"vmoe report: error: {e}", file=sys.stderr)
    return 2
  except OSError as e:
    print(f"vmoe report: error: cannot write the page: {e.strerror or e} ({e.filename}).",
          file=sys.stderr)
    return 1
  for page in pages:
    print(page)
  return 0
