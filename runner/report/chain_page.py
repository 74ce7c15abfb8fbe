"""A chain of stages on one page, each with what it started from, its main metric and a link to its
own page: a folder whose sub-folders are runs but not a sweep's numbered jobs (`runs/demo`). The
stages are listed in the order they started."""
from __future__ import annotations

import os
import pathlib

from runner.report import markup, run_page, workdir
from runner.config.subcommands import main_metric


def runs_in(path: pathlib.Path) -> list[pathlib.Path]:
  return [child for child in sorted(path.iterdir()) if child.is_dir() and workdir.is_run(child)]


def is_chain(path: pathlib.Path) -> bool:
  """Runs directly below, not all named as a sweep names its jobs (0, 1, ...)."""
  runs = runs_in(path)
  return bool(runs) and not all(run.name.isdigit() for run in runs)


def write_chain_page(path: str | pathlib.Path, out: str | pathlib.Path | None = None, *,
                     runs: list[pathlib.Path] | None = None) -> list[pathlib.Path]:
  """Writes each stage's page, then the chain's (<path>/report.html, or `out`); returns the
  pages written, the chain's last. `runs`: the stages in their order (default: every run
  folder below `path`, in the order they started). PathTaken, writing nothing, where any page's
  path holds anything but a page vmoe wrote."""
  path = pathlib.Path(path)
  run_page.check_replaceable(pages(path, out, runs=runs), out)
  stages = [workdir.read(run) for run in (runs if runs is not None else runs_in(path))]
  if runs is None:
    stages = _in_order(stages)
  written = [run_page.write_run_page(stage.path) for stage in stages]
  target = run_page.page_path(path, out)
  run_page.write_atomically(target, build(path, stages, target.parent))
  return written + [target]


def pages(path: str | pathlib.Path, out: str | pathlib.Path | None = None, *,
          runs: list[pathlib.Path] | None = None) -> list[pathlib.Path]:
  """The pages write_chain_page writes: each stage's, then the chain's."""
  stages = runs if runs is not None else runs_in(pathlib.Path(path))
  return [run_page.page_path(stage) for stage in stages] + [run_page.page_path(path, out)]


def _in_order(stages: list[workdir.Run]) -> list[workdir.Run]:
  """By start time, except that a stage never comes before a stage it started from."""
  remaining = sorted(stages, key=lambda s: (s.holder.started if s.holder else "", s.path.name))
  ordered: list[workdir.Run] = []
  while remaining:
    placed = {s.path.resolve() for s in ordered}
    pending = {s.path.resolve() for s in remaining}
    ready = next((s for s in remaining
                  if not any(o.run and o.run.resolve() in pending - placed
                             and o.run.resolve() != s.path.resolve() for o in s.origins)),
                 remaining[0])
    ordered.append(ready)
    remaining.remove(ready)
  return ordered


def _metric(stage: workdir.Run) -> str:
  if not stage.summary or stage.stage not in workdir.STAGES:
    return "-"
  try:
    return f"{main_metric(stage.stage, stage.summary):.4f}"
  except (KeyError, ValueError, StopIteration):
    return "-"


def build(path: pathlib.Path, stages: list[workdir.Run], page_dir: pathlib.Path) -> str:
  rows = []
  for stage in stages:
    page = os.path.relpath(stage.path / run_page.PAGE, page_dir)
    origins = [markup.link(os.path.relpath(o.run / run_page.PAGE, page_dir), o.run.name)
               if o.run else o.text for o in stage.origins]
    rows.append([markup.link(page, stage.path.name), stage.stage or "-",
                 markup.Raw(", ".join(markup.esc(o) for o in origins)) if origins else "-",
                 _metric(stage) if stage.summary else "running"])
  table = markup.table(["stage folder", "vmoe", "started from", "main metric"], rows)
  explain = markup.note(
      "Each stage's main metric is the one it returns to a sweeper: validation prec@1 for pretrain "
      "and finetune, the first dataset's prec@1 for eval and ensemble, the accuracy at the most "
      "shots for fewshot. Each stage's own page has its curves, expert load, metrics and pictures.")
  return markup.page(f"vmoe runs: {path.name or path}", f"{path.resolve()}: {len(stages)} stages",
                     [("stages", "Stages", table + explain)])
