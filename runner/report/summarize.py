"""`vmoe summarize <multirun dir>`: one table of a sweep's jobs, their overrides and final metrics.

Every job folder (one with a summary.json) is a row: the keys the sweep varies, then the metrics
(by default the stage's main metric and companions); `--aggregate seed` (the default) averages the
jobs differing only in those keys. The studies (runner/studies) build their tables likewise."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import pathlib
import statistics
import sys
from typing import Callable

import yaml

from runner.config import subcommands


@dataclasses.dataclass
class Job:
  path: pathlib.Path
  overrides: dict  # key -> value (as typed on the command line)
  summary: dict


@dataclasses.dataclass
class Column:
  """A table column: its header and how to read it from a summary (a key or a function)."""
  header: str
  value: str | Callable[[dict], float]
  digits: int = 4

  def read(self, summary: dict):
    return self.value(summary) if callable(self.value) else summary.get(self.value)


def find_jobs(root: str | pathlib.Path) -> list[Job]:
  """Every finished job under `root` (a folder holding summary.json), in natural folder order."""
  summaries = sorted(pathlib.Path(root).rglob("summary.json"),  # natural order: 2 before 10
                     key=lambda p: [int(x) if x.isdigit() else x for x in p.parent.parts])
  return [Job(s.parent, read_overrides(s.parent), json.loads(s.read_text())) for s in summaries]


def read_overrides(folder: pathlib.Path) -> dict:
  """A job folder's overrides (.hydra/overrides.yaml): key -> value, as typed."""
  overrides = {}
  path = folder / ".hydra" / "overrides.yaml"
  if path.exists():
    for line in yaml.safe_load(path.read_text()) or []:
      key, _, value = str(line).partition("=")
      overrides[key.lstrip("+~")] = value
  return overrides


def swept_keys(jobs: list[Job]) -> list[str]:
  """The override keys whose values differ between jobs (in the order they appear)."""
  keys = list(dict.fromkeys(k for job in jobs for k in job.overrides
                            if not k.startswith("workdir")))
  return [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]


def default_columns(jobs: list[Job]) -> list[Column]:
  """The main metric of the jobs' stage, then what a reader checks next (the stage's record,
  runner/config/subcommands.py)."""
  summary = jobs[0].summary
  stage = subcommands.get(subcommands.stage_of(summary))
  return [Column(*spec) for spec in stage.columns(summary)]


def mean_std(values: list, digits: int = 4) -> str:
  """"m ± s" of the numbers among `values` ("-" for none; a single one without ±)."""
  texts = [v for v in values if isinstance(v, str)]
  if texts:  # a column of text (e.g. formatted counts): the replicates' values
    return " / ".join(dict.fromkeys(texts))
  numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
             and math.isfinite(float(v))]
  if not numbers:
    return "-"
  if len(numbers) == 1:
    return f"{numbers[0]:.{digits}f}"
  return f"{statistics.mean(numbers):.{digits}f} ± {statistics.stdev(numbers):.{digits}f}"


def grouped(rows: list[tuple], columns: list[Column], label: str | tuple = "") -> tuple[list, list]:
  """(header, body) of a table with one row per (label, summaries of its replicates); a label
  may be a tuple (several leading columns, named by a tuple `label`)."""
  names = list(label) if isinstance(label, tuple) else [label]
  header = [*names, *(c.header for c in columns), "n"]
  body = [[*(name if isinstance(name, tuple) else (name,)),
           *(mean_std([c.read(s) for s in summaries], c.digits) for c in columns),
           str(len(summaries))] for name, summaries in rows]
  return header, body


def sweep_table(jobs: list[Job], columns: list[Column], aggregate: tuple[str, ...] = ("seed",)
                ) -> tuple[list, list]:
  """(header, body): one row per combination of the swept keys but `aggregate`."""
  keys = [k for k in swept_keys(jobs) if k not in aggregate]
  groups: dict[tuple, list[dict]] = {}
  for job in jobs:
    groups.setdefault(tuple(job.overrides.get(k, "-") for k in keys), []).append(job.summary)
  return grouped(list(groups.items()), columns, label=tuple(keys))


def markdown(header: list, body: list) -> str:
  lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in body])


def to_csv(header: list, body: list) -> str:
  out = io.StringIO()
  csv.writer(out).writerows([header, *body])
  return out.getvalue()


def plot(jobs: list[Job], key: str, column: Column, path: pathlib.Path) -> str:
  """The column against one swept key: every job a point, the mean a line (a log x-axis for
  positive numbers spanning a decade or more)."""
  # lazily: matplotlib is slow to import, and only the plots need it (not the tables, the studies)
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  points = [(job.overrides.get(key), column.read(job.summary)) for job in jobs]
  points = [(x, y) for x, y in points if x is not None and isinstance(y, (int, float))]
  numeric = all(_number(x) is not None for x, _ in points)
  order = sorted({x for x, _ in points}, key=lambda x: _number(x) if numeric else x)
  position = {x: (_number(x) if numeric else i) for i, x in enumerate(order)}
  figure = Figure(figsize=(5, 3.6), dpi=100)
  FigureCanvasAgg(figure)
  axes = figure.add_subplot()
  axes.plot([position[x] for x, _ in points], [y for _, y in points], "o", alpha=0.6)
  means = [statistics.mean(y for x2, y in points if x2 == x) for x in order]
  axes.plot([position[x] for x in order], means, "-", color="black", label="mean")
  if numeric and min(position.values()) > 0 and max(position.values()) >= 10 * min(
      position.values()):
    axes.set_xscale("log")
  if not numeric:
    axes.set_xticks(range(len(order)), order, rotation=20, fontsize=8)
  axes.set_xlabel(key)
  axes.set_ylabel(column.header)
  axes.grid(alpha=0.3)
  axes.legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(str(path), format="png")
  return str(path)


def _number(text) -> float | None:
  try:
    return float(text)
  except (TypeError, ValueError):
    return None


def summarize(root: str | pathlib.Path, metrics: list[str] | None = None,
              aggregate: tuple[str, ...] = ("seed",), plots: bool = True) -> str:
  """Writes summary.md, summary.csv and the plots into `root`; returns the Markdown table."""
  root = pathlib.Path(root)
  jobs = find_jobs(root)
  if not jobs:
    raise FileNotFoundError(f"{root} holds no finished job (no summary.json below it)")
  columns = [Column(m, m) for m in metrics] if metrics else default_columns(jobs)
  header, body = sweep_table(jobs, columns, aggregate)
  text = markdown(header, body)
  (root / "summary.md").write_text(text + "\n")
  (root / "summary.csv").write_text(to_csv(header, body))
  if plots:
    for key in swept_keys(jobs):
      plot(jobs, key, columns[0], root / f"summary_{key.replace('/', '_')}.png")
  return text


def arguments() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="vmoe summarize", description=__doc__.split("\n")[0])
  parser.add_argument("directory", help="a multirun folder (or any folder of runs)")
  parser.add_argument("--metrics", default="", help="comma-separated summary keys (default: "
                      "the stage's main metric and its companions)")
  parser.add_argument("--aggregate", default="seed", help="comma-separated swept keys to "
                      "average over (mean ± std); empty: none")
  parser.add_argument("--no-plots", action="store_true")
  parser.add_argument("--no-report", action="store_true", help="do not refresh the sweep's "
                      "report.html (vmoe report)")
  return parser


def main(argv: list[str]) -> int:
  args = arguments().parse_args(argv)
  root = pathlib.Path(args.directory)
  if not root.is_dir():
    print(f"vmoe summarize: error: {root} is not a directory; give the folder of a sweep "
          "(its workdir, e.g. runs/sweeps/finetune_lr/<date>).", file=sys.stderr)
    return 2
  try:
    text = summarize(root, [m for m in args.metrics.split(",") if m],
                     tuple(k for k in args.aggregate.split(",") if k), not args.no_plots)
  except FileNotFoundError as e:
    print(f"vmoe summarize: error: {e}; run the sweep first.", file=sys.stderr)
    return 2
  print(text)
  print(f"\n(written to {root / 'summary.md'}, {root / 'summary.csv'})")
  return 0
