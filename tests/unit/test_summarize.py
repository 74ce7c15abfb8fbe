"""vmoe summarize: a sweep's jobs as one table (Markdown, CSV, plots), and each stage's main metric."""
from __future__ import annotations

import csv
import io
import json
import pathlib
import statistics

import pytest
import yaml

from runner.report import summarize
from runner.config.subcommands import main_metric, stage_of


def _job(root, num, overrides, summary):
  folder = root / str(num)
  (folder / ".hydra").mkdir(parents=True)
  (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
  (folder / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def sweep(tmp_path):
  values = {}
  for num, (lr, seed) in enumerate([(l, s) for l in ("0.001", "0.01") for s in (0, 1)]):
    acc = {"0.001": 0.5, "0.01": 0.7}[lr] + 0.01 * seed
    values.setdefault(lr, []).append(acc)
    _job(tmp_path, num, [f"optim.lr={lr}", f"seed={seed}", "train.steps=3"],
         {"step": 3, "val/prec@1": acc, "val/nll": 1 - acc, "test/prec@1": acc - 0.02,
          "test/nll": 1.1 - acc})
  return tmp_path, values


def test_the_table_averages_seeds_per_swept_value(sweep, run_cli):
  root, values = sweep
  code, out, err = run_cli("summarize", str(root))
  assert code == 0, err
  table = (root / "summary.md").read_text()
  assert table.splitlines()[0] == ("| optim.lr | val prec@1 | val NLL | test prec@1 | test NLL | "
                                   "n |")
  for lr, accs in values.items():
    mean, std = statistics.mean(accs), statistics.stdev(accs)
    assert f"| {lr} | {mean:.4f} ± {std:.4f} |" in table
  assert table in out
  rows = list(csv.reader(io.StringIO((root / "summary.csv").read_text())))
  assert rows[0][0] == "optim.lr" and [r[0] for r in rows[1:]] == ["0.001", "0.01"]
  assert (root / "summary_optim.lr.png").stat().st_size > 1000
  assert (root / "summary_seed.png").exists()
  # The sweep's vmoe report page is refreshed too, with each job's page linked.
  assert f"(the sweep's page, each job's linked: {root / 'report.html'})" in out
  page = (root / "report.html").read_text()
  assert all(f'href="{job}/report.html"' in page for job in range(4))
  assert all((root / str(job) / "report.html").exists() for job in range(4))


def test_a_token_choice_sweep_shows_its_balance(tmp_path):
  """The worst layer's MaxVio and the dead and saturated experts of all layers, beside the
  stage's metrics, averaged over seeds as they are."""
  for num, (gate, seed) in enumerate([(g, s) for g in ("softmax", "sigmoid") for s in (0, 1)]):
    vio = {"softmax": 0.4, "sigmoid": 0.2}[gate] + 0.1 * seed
    _job(tmp_path, num, [f"model.router.gate={gate}", f"seed={seed}"],
         {"val/prec@1": 0.5, "val/nll": 1.0, "test/prec@1": 0.5, "test/nll": 1.0,
          "moe/layer_1/max_violation": vio, "moe/layer_3/max_violation": vio / 2,
          "moe/layer_1/dead_experts": 1.0, "moe/layer_3/dead_experts": float(seed),
          "moe/layer_1/saturated_experts": 2.0, "moe/layer_3/saturated_experts": 0.0})
  header, body = summarize.sweep_table(summarize.find_jobs(tmp_path),
                                       summarize.default_columns(summarize.find_jobs(tmp_path)))
  assert header[-4:] == ["MaxVio (worst layer)", "dead experts", "saturated experts", "n"]
  rows = {row[0]: row[-4:-1] for row in body}
  assert rows["softmax"] == [f"0.450 ± {statistics.stdev([0.4, 0.5]):.3f}",
                             f"1.5 ± {statistics.stdev([1, 2]):.1f}", "2.0 ± 0.0"]
  assert rows["sigmoid"][0] == f"0.250 ± {statistics.stdev([0.2, 0.3]):.3f}"


def test_metrics_and_no_aggregation_on_request(sweep, run_cli):
  root, _ = sweep
  code, _, err = run_cli("summarize", str(root), "--metrics", "test/nll", "--aggregate", "",
                         "--no-plots", "--no-report")
  assert code == 0, err
  lines = (root / "summary.md").read_text().splitlines()
  assert lines[0] == "| optim.lr | seed | test/nll | n |" and len(lines) == 2 + 4
  assert not list(root.glob("*.png")) and not list(root.rglob("report.html"))


def test_a_folder_without_jobs_is_a_clear_error(tmp_path, run_cli):
  code, _, err = run_cli("summarize", str(tmp_path))
  assert code == 2 and "no finished job" in err and "Traceback" not in err
  code, _, err = run_cli("summarize", str(tmp_path / "nope"))
  assert code == 2 and "is not a directory" in err


def test_main_metric_of_each_stage():
  assert main_metric("pretrain", {"val/prec@1": 0.4, "test/prec@1": 0.9}) == 0.4
  assert main_metric("eval", {"split": "test", "uci_digits/prec@1": 0.8,
                              "lfw_faces/prec@1": 0.1, "capacity_sweep/C_1/vanilla/prec@1": 0.2}
                     ) == 0.8
  assert main_metric("fewshot", {"mean/1shot/accuracy": 0.3, "mean/25shot/accuracy": 0.9,
                                 "mean/5shot/accuracy": 0.6}) == 0.9
  compressed = {"compress/experts": 4, "calibration/prec@1_before": 0.7, "calibration/prec@1": 0.6}
  assert main_metric("compress", compressed) == 0.6
  assert stage_of(compressed) == "compress"
  assert [c.header for c in summarize.default_columns(
      [summarize.Job(pathlib.Path("x"), {}, compressed)])][:2] == ["experts kept",
                                                                  "calibration prec@1"]
  with pytest.raises(ValueError, match="unknown stage"):
    main_metric("train", {})


def test_grouped_table_of_replicates_with_label_columns():
  header, body = summarize.grouped(
      [(("vit", "DET"), [{"a": 1.0}, {"a": 3.0}]), (("vmoe", "HET"), [{"a": 2.0}])],
      [summarize.Column("a", "a", 2), summarize.Column("twice", lambda s: 2 * s["a"], 1)],
      label=("model", "head"))
  assert header == ["model", "head", "a", "twice", "n"]
  assert body == [["vit", "DET", "2.00 ± 1.41", "4.0 ± 2.8", "2"],
                  ["vmoe", "HET", "2.00", "4.0", "1"]]
