"""The table a sweep prints when it ends (runner/command/sweep_table.py), on job
folders made by hand; tests/integration/test_sweeps.py prints it after real sweeps."""
from __future__ import annotations

import json
import pathlib

import yaml

from runner.command.sweep_table import job_files, sweep_table


def _job(folder: pathlib.Path, overrides: list[str], summary: dict | None) -> None:
  (folder / ".hydra").mkdir(parents=True, exist_ok=True)
  (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
  if summary is not None:
    (folder / "summary.json").write_text(json.dumps(summary))


def test_only_the_jobs_this_sweep_started_are_rows_in_number_order(tmp_path):
  sweep = tmp_path / "sweep"
  _job(sweep / "7", ["workdir=sweep", "seed=7"], {"val/prec@1": 0.9})  # an earlier sweep's
  before = job_files(sweep)
  for number, seed in ((10, 3), (2, 1)):
    _job(sweep / str(number), ["workdir=sweep", "optim.lr=0.1", f"seed={seed}"],
         {"val/prec@1": 0.25 * seed, "val/nll": 1.0})
  _job(sweep / "3", ["workdir=sweep", "optim.lr=0.1", "seed=2"], None)  # started, no summary
  text = sweep_table(sweep, "finetune", before)
  lines = text.splitlines()
  assert lines[0] == "Sweep " + str(sweep) + ": 3 job(s), 2 ok, 1 failed"
  assert lines[1:5] == ["| job | seed | status | val/prec@1 |", "|---|---|---|---|",
                        "| 2 | 1 | ok | 0.2500 |", "| 3 | 2 | failed | - |"]
  assert lines[5] == "| 10 | 3 | ok | 0.7500 |"
  assert f"vmoe summarize {sweep}" in lines[-1] and f"vmoe report {sweep}" in lines[-1]


def test_a_rerun_job_that_failed_is_not_read_as_its_earlier_success(tmp_path):
  sweep = tmp_path / "sweep"
  _job(sweep / "0", ["seed=0"], {"val/prec@1": 0.5})
  before = job_files(sweep)
  (sweep / "0" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["seed=0", "x=1"]))
  (sweep / "0" / "launcher.log").write_text("Traceback ...\n")
  text = sweep_table(sweep, "pretrain", before)
  assert "| 0 | failed | - |" in text  # a single job: no swept key
  assert f"The failed jobs' output: {sweep / '0' / 'launcher.log'}" in text


def test_a_sweep_that_started_no_job_prints_nothing(tmp_path):
  assert sweep_table(tmp_path / "never_made", "eval", {}) is None
