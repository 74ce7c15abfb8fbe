"""A sweep's page: a row per job, the best job, each swept key against the main metric, the
seeds' mean ± std, an Optuna search's best trial, and a link to every job's own page. The tables
are `vmoe summarize`'s; "best" is the main metric each stage returns to Hydra's sweeper
(runner/config/subcommands.py), what an Optuna search maximises."""
from __future__ import annotations

import dataclasses
import math
import os
import pathlib

import yaml

from runner.report import final_metrics, markup, plots, run_page, summarize, workdir
from runner.report.markup import Raw, esc
from runner.config.subcommands import main_metric, stage_of


@dataclasses.dataclass
class Sweep:
  path: pathlib.Path
  jobs: list[summarize.Job]
  keys: list[str]  # the swept keys
  columns: list[summarize.Column]  # the stage's companion metrics
  scores: list[float | None]  # each job's main metric
  unfinished: list[pathlib.Path]  # job folders without a summary.json yet
  optuna: dict | None  # optimization_results.yaml

  @property
  def best(self) -> int | None:
    scored = [(s, -i) for i, s in enumerate(self.scores) if s is not None and math.isfinite(s)]
    return -max(scored)[1] if scored else None


def is_sweep(path: pathlib.Path) -> bool:
  return bool(summarize.find_jobs(path))


def read(path: str | pathlib.Path) -> Sweep:
  path = pathlib.Path(path)
  jobs = summarize.find_jobs(path)
  try:
    columns = summarize.default_columns(jobs)
  except (StopIteration, KeyError):  # a summary without the stage's usual metrics
    columns = []
  finished = {job.path for job in jobs}
  unfinished = sorted((p for p in path.iterdir() if p.is_dir() and p not in finished
                       and (p / "metrics.jsonl").is_file()),
                      key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0,
                                     p.name))
  try:
    optuna = yaml.safe_load((path / "optimization_results.yaml").read_text())
  except (FileNotFoundError, IsADirectoryError, yaml.YAMLError):  # none, or not YAML
    optuna = None
  return Sweep(path, jobs, summarize.swept_keys(jobs), columns, [_score(j) for j in jobs],
               unfinished, optuna if isinstance(optuna, dict) else None)


def _score(job: summarize.Job) -> float | None:
  try:
    return main_metric(stage_of(job.summary), job.summary)
  except (KeyError, StopIteration, ValueError, TypeError):
    return None


def write_sweep_page(path: str | pathlib.Path, out: str | pathlib.Path | None = None
                     ) -> list[pathlib.Path]:
  """Writes every job's page, then the sweep's (<sweep>/report.html, or `out`); returns the
  paths written, the sweep's last. PathTaken, writing nothing, where any page's path holds
  anything but a page vmoe wrote."""
  sweep = read(path)
  run_page.check_replaceable(_pages(sweep, out), out)
  written = [run_page.write_run_page(folder) for folder in _job_folders(sweep)]
  target = run_page.page_path(sweep.path, out)
  run_page.write_atomically(target, build(sweep, target.parent))
  return written + [target]


def pages(path: str | pathlib.Path, out: str | pathlib.Path | None = None) -> list[pathlib.Path]:
  """The pages write_sweep_page writes: each job's, then the sweep's."""
  return _pages(read(path), out)


def _pages(sweep: Sweep, out: str | pathlib.Path | None) -> list[pathlib.Path]:
  return ([run_page.page_path(folder) for folder in _job_folders(sweep)]
          + [run_page.page_path(sweep.path, out)])


def _job_folders(sweep: Sweep) -> list[pathlib.Path]:
  """The finished jobs, then the unfinished ones: each gets its page."""
  return [job.path for job in sweep.jobs] + sweep.unfinished


def _job_link(folder: pathlib.Path, sweep: Sweep, page_dir: pathlib.Path) -> Raw:
  name = os.path.relpath(folder, sweep.path)
  return markup.link(os.path.relpath(folder / run_page.PAGE, page_dir), name)


def build(sweep: Sweep, page_dir: pathlib.Path) -> str:
  first = sweep.jobs[0] if sweep.jobs else None
  stage = workdir.stage(first.path, workdir.read_holder(first.path), first.summary) if first else ""
  sections = [("jobs", "Jobs", _jobs(sweep, page_dir)),
              ("best", "Best job", _best(sweep, page_dir)),
              ("keys", "Swept keys against the main metric", _scatter(sweep)),
              ("seeds", "Mean ± std over seeds", _seeds(sweep))]
  if sweep.optuna is not None:
    sections.append(("optuna", "Optuna search", _optuna(sweep, page_dir)))
  title = f"vmoe sweep: {sweep.path.name or sweep.path}"
  subtitle = (f"{sweep.path.resolve()}: {len(sweep.jobs)} finished jobs"
              + (f", {len(sweep.unfinished)} unfinished" if sweep.unfinished else "")
              + (f" of vmoe {stage}" if stage else ""))
  return markup.page(title, subtitle, sections, script=True)


def _jobs(sweep: Sweep, page_dir: pathlib.Path) -> str:
  header = ["job", *sweep.keys, "main metric", *(c.header for c in sweep.columns)]
  rows, classes = [], []
  for i, job in enumerate(sweep.jobs):
    score = sweep.scores[i]
    marker = " ★ best" if i == sweep.best else ""
    rows.append([_job_link(job.path, sweep, page_dir), *(job.overrides.get(k, "-")
                                                         for k in sweep.keys),
                 (final_metrics.fmt(score) if score is not None else "-") + marker,
                 *(final_metrics.fmt(c.read(job.summary)) if c.read(job.summary) is not None
                   else "-" for c in sweep.columns)])
    classes.append("best" if i == sweep.best else "")
  for folder in sweep.unfinished:
    rows.append([_job_link(folder, sweep, page_dir), *("" for _ in sweep.keys),
                 "unfinished (no summary.json)", *("" for _ in sweep.columns)])
    classes.append("")
  first = sweep.jobs[0].overrides if sweep.jobs else {}
  fixed = [f"{k}={v}" for k, v in first.items() if k not in sweep.keys
           and not k.startswith("workdir") and all(j.overrides.get(k) == v for j in sweep.jobs)]
  text = markup.note("Every job ran with " + (" ".join(fixed) if fixed else "no other override")
                     + (f"; the jobs differ in {', '.join(sweep.keys)}." if sweep.keys else "."))
  text += markup.table(header, rows, sortable=True, row_classes=classes)
  return text + markup.note("The main metric is the one the stage returns to a sweeper "
                            "(higher is better). Click a column's header to sort by it.")


def _best(sweep: Sweep, page_dir: pathlib.Path) -> str:
  best = sweep.best
  if best is None:
    return markup.note("No job has a main metric to compare.")
  job = sweep.jobs[best]
  overrides = " ".join(f"{k}={job.overrides[k]}" for k in sweep.keys if k in job.overrides)
  return Raw(f"<p>{_job_link(job.path, sweep, page_dir)}: main metric "
             f"<b>{esc(final_metrics.fmt(sweep.scores[best]))}</b>"
             f"{' with ' + esc(overrides) if overrides else ''}.</p>")


def _scatter(sweep: Sweep) -> str:
  if not sweep.keys:
    return markup.note("The jobs do not differ in any override.")
  figures = []
  for key in sweep.keys:
    points = [(job.overrides.get(key), score, i) for i, (job, score)
              in enumerate(zip(sweep.jobs, sweep.scores)) if score is not None
              and job.overrides.get(key) is not None]
    if not points:
      continue
    xs, ys, indices = zip(*points)
    best = indices.index(sweep.best) if sweep.best in indices else None
    figures.append(markup.figure(plots.scatter(key, xs, ys, key, "main metric", best)))
  return markup.grid(figures) or markup.note("No job has a main metric to plot.")


def _seeds(sweep: Sweep) -> str:
  if not sweep.columns:
    return markup.note("The jobs' summaries have none of the stage's usual metrics.")
  header, body = summarize.sweep_table(sweep.jobs, sweep.columns)
  return markup.table(header, body, sortable=True) + markup.note(
      "As `vmoe summarize` prints it: the jobs that differ only in their seed, averaged.")


def _optuna(sweep: Sweep, page_dir: pathlib.Path) -> str:
  params = sweep.optuna.get("best_params")
  rows = [[k, v] for k, v in params.items()] if isinstance(params, dict) else []
  text = markup.table(["best parameter", "value"], rows) if rows else ""
  text += Raw(f"<p>best value: <b>{esc(sweep.optuna.get('best_value', '-'))}</b></p>")
  match = next((job for job in sweep.jobs if rows and all(
      _same(job.overrides.get(str(k)), v) for k, v in rows)), None)
  if match is not None:
    text += Raw(f"<p>the trial's job: {_job_link(match.path, sweep, page_dir)}</p>")
  return text


def _same(text, value) -> bool:
  if text is None:
    return False
  try:
    return math.isclose(float(text), float(value), rel_tol=1e-9)
  except (TypeError, ValueError):
    return str(text) == str(value)
