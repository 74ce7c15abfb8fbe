"""The table a sweep prints when it ends: each job's number, swept values, status, main metric.

A Hydra callback (conf/hydra/env/vmoe.yaml) of the process that runs `vmoe <stage> --multirun`, so
one piece of code serves every launcher (the jobs run in that process, as processes of their own or
on SLURM's nodes; the command waits for all). Jobs are read from their folders as `vmoe summarize`
reads them (runner/report/summarize.py): a job of this sweep is a folder whose .hydra/overrides.yaml
was written since the sweep began, and it succeeded if it wrote its summary.json since then too (a
rerun into an older sweep's folder shows only the jobs it ran). A failed job stops the sweep (the
basic launcher at that job, the parallel one at the end of its batch) before the callback hears of
its end; print_stopped_sweep then prints the table as the command exits."""
from __future__ import annotations

import json
import os
import pathlib
import shlex

from hydra.experimental.callback import Callback

from runner.report import summarize
from runner.config import subcommands


class SweepTable(Callback):

  def __init__(self) -> None:
    self.sweep_dir = pathlib.Path()
    self.before: dict = {}  # the sweep folder's job files as the sweep began: path -> mtime

  def on_multirun_start(self, config, **kwargs) -> None:
    global _begun
    self.sweep_dir = pathlib.Path(str(config.hydra.sweep.dir))
    self.before = job_files(self.sweep_dir)
    _begun = self

  def on_multirun_end(self, config, **kwargs) -> None:
    global _begun
    _begun = None
    self.show()

  def show(self) -> None:
    if text := sweep_table(self.sweep_dir, os.environ.get("VMOE_STAGE"), self.before):
      print(text, flush=True)


_begun: SweepTable | None = None  # the sweep of this process that has begun and not ended


def print_stopped_sweep() -> None:
  """The table of this process's sweep if a failed job stopped it (Hydra raised before its end)."""
  global _begun
  stopped, _begun = _begun, None
  if stopped is not None:
    stopped.show()


def job_files(sweep_dir: pathlib.Path) -> dict:
  """Every job's .hydra/overrides.yaml and summary.json under `sweep_dir`: path -> mtime (ns)."""
  if not sweep_dir.is_dir():
    return {}
  return {path: path.stat().st_mtime_ns for name in ("overrides.yaml", "summary.json")
          for path in sweep_dir.rglob(name)}


def sweep_table(sweep_dir: pathlib.Path, stage: str | None, before: dict) -> str | None:
  """The jobs that started since `before` (job_files then), one row each; None for none."""
  now = job_files(sweep_dir)
  started = sorted((path.parent.parent for path, stamp in now.items()
                    if path.name == "overrides.yaml" and path.parent.name == ".hydra"
                    and before.get(path) != stamp),
                   key=lambda folder: _natural(folder.relative_to(sweep_dir)))
  if not started:
    return None
  jobs, finished = [], []
  for folder in started:
    summary = folder / "summary.json"
    done = summary in now and before.get(summary) != now[summary]
    finished.append(done)
    jobs.append(summarize.Job(folder, summarize.read_overrides(folder),
                              json.loads(summary.read_text()) if done else {}))
  keys = summarize.swept_keys(jobs)
  metric = (subcommands.get(stage).main_metric.split(" (")[0] if stage in subcommands.SUBCOMMANDS
            else "main metric")
  header = ["job", *keys, "status", metric]
  body = [[str(job.path.relative_to(sweep_dir)), *(job.overrides.get(k, "-") for k in keys),
           "ok" if done else "failed", _main_metric(stage, job.summary) if done else "-"]
          for job, done in zip(jobs, finished)]
  where = shlex.quote(str(sweep_dir))
  failed = finished.count(False)
  logs = [str(job.path / "launcher.log") for job, done in zip(jobs, finished)
          if not done and (job.path / "launcher.log").is_file()]  # hydra/launcher=parallel's
  return "\n".join([
      f"Sweep {where}: {len(jobs)} job(s), {len(jobs) - failed} ok, {failed} failed",
      summarize.markdown(header, body),
      *([f"The failed jobs' output: {' '.join(logs)}"] if logs else []),
      f"Compare them: vmoe summarize {where} (seeds averaged, plots), "
      f"vmoe report {where} (a page per job)"])


def _main_metric(stage: str | None, summary: dict) -> str:
  try:
    return f"{subcommands.main_metric(stage or subcommands.stage_of(summary), summary):.4f}"
  except (KeyError, StopIteration, ValueError, TypeError):  # a summary without that metric
    return "-"


def _natural(path: pathlib.Path) -> list:
  """Job folders in number order (2 before 10), named ones after."""
  return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.parts]
