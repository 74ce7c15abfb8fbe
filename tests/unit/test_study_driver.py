"""A study's sweep: where each stage's run goes, and a rerun skipping the runs that ended."""
from __future__ import annotations

import json

from runner.studies import driver


def test_a_stage_runs_in_its_folder_once(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(driver.cli, "main", lambda argv: calls.append(argv) or 0)
  sweep = driver.Sweep("study-x", tmp_path)
  sweep.stage("eval", "router_ec", 1, ["init.checkpoint=a"], ["seed=3"])
  workdir = tmp_path / "eval" / "router_ec" / "seed_1"
  assert calls == [["eval", f"workdir={workdir}", "init.checkpoint=a", "seed=3"]]
  workdir.mkdir(parents=True)
  (workdir / "summary.json").write_text(json.dumps({"uci_digits/prec@1": 0.5}))
  sweep.stage("eval", "router_ec", 1, ["init.checkpoint=a"], ["seed=3"])
  assert len(calls) == 1  # ended: skipped
  assert sweep.summary("eval", "router_ec", 1) == {"uci_digits/prec@1": 0.5}


def test_a_failed_stage_stops_the_study_naming_it(tmp_path, monkeypatch):
  monkeypatch.setattr(driver.cli, "main", lambda argv: 2)
  try:
    driver.Sweep("study-x", tmp_path).stage("finetune", "e", 0, [], [])
  except SystemExit as e:
    assert str(e) == "study-x: vmoe finetune failed (exit 2)"
  else:
    raise AssertionError("a failed stage must stop the study")
