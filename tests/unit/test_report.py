"""vmoe report: one offline HTML page per run and per sweep, from workdirs written here in the
formats the stages write (metrics.jsonl, summary.json, .hydra/overrides.yaml, config.yaml,
.vmoe.lock, the evaluators' PNGs, checkpoints/<step>/).

What a page promises: every section, every MoE layer's expert-load heat map, nothing fetched
from anywhere (every src/href a data: URI, an anchor or a relative report.html link), a bounded
size however long the run, the strings of the files escaped; a sweep's page lists every job
and marks the best; bad paths write nothing; a page replaces only a page vmoe wrote; a live
run's page says it is in progress; a short training run's page shows its one logged point.
"""
from __future__ import annotations

import html.parser
import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest
import yaml
from conftest import fails_clearly

from runner.evaluators import suite
from runner.report import curves, markup, run_page, summarize, sweep_page
from runner.workdirs.workdir_lock import LOCK_FILE, WorkdirLock

RUN_SECTIONS = {"run", "config", "training", "validation", "routing", "metrics", "pictures",
                "checkpoints"}


def _png() -> bytes:
  """A valid 2x2 grey PNG, as an evaluator's picture."""
  def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(
        ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
  raw = b"".join(b"\x00" + bytes([128, 128]) for _ in range(2))
  return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 0, 0, 0, 0))
          + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def make_run(folder: pathlib.Path, *, steps: int = 12, layers=(1, 3), experts: int = 8,
             overrides=("model=vmoe_tiny", "optim.lr=0.003"), summary: dict | None = None,
             config: dict | None = None, stage: str = "pretrain") -> pathlib.Path:
  """A finished run's workdir: expert 0 of every layer dead, expert 1 saturated."""
  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  with open(folder / "metrics.jsonl", "w") as out:
    for step in range(1, steps + 1):
      noise = rng.uniform(0.9, 1.1, 8)  # noisy curves: matplotlib cannot simplify them away
      record = {"step": step, "train/loss": 2.3 / step ** 0.1 * noise[0],
                "train/prec@1": min(1, step / 50) * noise[1],
                "train/lr": 0.003 * min(1, step / 5), "train/images_per_s": 600.0 * noise[2],
                "train/aux_loss": 0.05 * noise[3], "train/cls_loss": 2.2 * noise[4],
                "train/grad_norm": 1.1 * noise[5]}
      for layer in layers:
        load = rng.uniform(0.2, 0.9, experts).round(4)
        load[0], load[1] = 0.0, 1.0
        record.update({f"moe/layer_{layer}/expert_load": load.tolist(),
                       f"moe/layer_{layer}/auxiliary_loss": 0.05 * noise[3],
                       f"moe/layer_{layer}/importance_loss": 0.002 * noise[6],
                       f"moe/layer_{layer}/load_loss": 0.1 * noise[7],
                       f"moe/layer_{layer}/fraction_dropped_tokens": 0.01 * noise[6],
                       f"moe/layer_{layer}/fraction_dropped_assignments": 0.1 * noise[7]})
      if step % 4 == 0:
        record.update({"val/prec@1": step / 100, "val/loss": 2.0, "val/nll": 2.0,
                       "val/moe/layer_1/fraction_dropped_tokens": 0.05})
      out.write(json.dumps(record) + "\n")
  summary = summary if summary is not None else {
      "step": steps, "val/prec@1": 0.42, "val/nll": 1.5, "test/prec@1": 0.4, "test/nll": 1.6,
      "mnist5k/ece": 0.1, "routing/layer_1/top1": 0.2, "routing/layer_3/top1": 0.3,
      "compute/gflops_per_image": 0.001, "params/total": 49194,
      "moe/layer_1/expert_load": [0.0, 1.0, 0.5]}
  (folder / "summary.json").write_text(json.dumps(summary, indent=2))
  (folder / ".hydra").mkdir(exist_ok=True)
  (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
  (folder / "config.yaml").write_text(yaml.safe_dump(config or {"seed": 0, "plugins": []}))
  (folder / "reliability_mnist5k.png").write_bytes(_png())
  (folder / "routing_classes.png").write_bytes(_png())
  (folder / "environment.json").write_text(json.dumps({
      "git_commit": "0123abc +changes", "packages": {"jax": "0.10.2", "flax": "0.12.8"},
      "devices": "1 x cpu (cpu)", "processes": 1, "host": "lab", "python": "3.12.3"}))
  (folder / "checkpoints" / str(steps)).mkdir(parents=True, exist_ok=True)
  (folder / "checkpoints" / str(steps) / "commit_success.txt").write_text("done")
  (folder / LOCK_FILE).write_text(f"pid 1 on host lab, started 2026-11-26 10:00:00: vmoe {stage} "
                                  + " ".join(overrides) + "\n")
  return folder


class _Page(html.parser.HTMLParser):
  """What a test reads of a page: section ids, headings, every src/href, scripts and links."""

  def __init__(self, text: str):
    super().__init__()
    self.sections, self.headings, self.urls, self.tags = [], [], [], []
    self._heading = None
    self.feed(text)

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    self.tags.append((tag, attrs))
    if tag == "section":
      self.sections.append(attrs.get("id"))
    if tag in ("h2", "h3"):
      self._heading = ""
    for name in ("src", "href", "xlink:href", "action", "poster", "srcset"):
      if attrs.get(name) is not None:
        self.urls.append((tag, name, attrs[name]))

  def handle_data(self, data):
    if self._heading is not None:
      self._heading += data

  def handle_endtag(self, tag):
    if tag in ("h2", "h3") and self._heading is not None:
      self.headings.append(self._heading.strip())
      self._heading = None


def assert_offline(text: str) -> _Page:
  """Every src/href is a data: URI, an anchor or a relative link to a report.html; no script
  comes from a file, no stylesheet or other resource is linked."""
  page = _Page(text)
  for tag, name, url in page.urls:
    lowered = url.strip().lower()
    assert not lowered.startswith(("http:", "https:", "//", "file:", "ftp:")), (tag, name, url)
    ok = (lowered.startswith("data:") or lowered.startswith("#")
          or (name == "href" and tag == "a" and url.split("#")[0].endswith("report.html")
              and not os.path.isabs(url)))
    assert ok, (tag, name, url)
  assert not [t for t, a in page.tags if t == "link"], "a <link> element"
  assert not [t for t, a in page.tags if t == "script" and "src" in a], "a <script src>"
  assert not [t for t, a in page.tags if t in ("iframe", "object", "embed", "base")]
  assert "Content-Security-Policy" in text
  return page


def test_run_page_has_every_section_and_a_heat_map_per_moe_layer(tmp_path):
  run = make_run(tmp_path / "up", overrides=("optim.lr=0.003", "logger.wandb.name=<b>x&y</b>"))
  path = run_page.write_run_page(run)
  assert path == run / "report.html"
  text = path.read_text()
  page = assert_offline(text)
  assert RUN_SECTIONS <= set(page.sections), page.sections
  for heading in ("Run", "Configuration", "Training curves", "Validation curves",
                  "Expert load and dropped tokens", "Final metrics", "Pictures", "Checkpoints",
                  "val/", "test/", "mnist5k/", "routing/", "compute/"):
    assert heading in page.headings, heading
  # A steps x experts heat map per MoE layer, with its dead and saturated experts named.
  for layer in (1, 3):
    assert f"moe/layer_{layer}/expert_load: logged steps x experts" in text
  assert text.count("dead experts 0; saturated experts 1.") == 2
  assert text.count("<svg") >= 10  # the curves, the two maps
  assert "moe/layer_*/fraction_dropped_tokens" in text and "moe/layer_*/auxiliary_loss" in text
  # What ran: the stage, the command line, the host, the overrides; strings from files escaped.
  assert "vmoe pretrain: up" in text and "<td>lab</td>" in text and "<td>optim.lr</td>" in text
  assert "<b>x&y</b>" not in text and "&lt;b&gt;x&amp;y&lt;/b&gt;" in text
  # What it ran on (environment.json): the commit, the packages, the devices.
  for fact in ("<td>0123abc +changes</td>", "jax 0.10.2, flax 0.12.8", "<td>1 x cpu (cpu)</td>"):
    assert fact in text, fact
  # The pictures inline, the checkpoint listed, the per-layer summary as a column per layer.
  assert text.count('src="data:image/png;base64,') == 2
  assert "reliability_mnist5k.png" in text and "complete" in text
  assert "<th>layer_1</th><th>layer_3</th>" in text
  assert "In progress" not in text
  assert "records in metrics.jsonl; every one is drawn" in text


def test_token_choice_balance_is_charted_explained_and_tabled(tmp_path):
  """max_violation, dead_experts and saturated_experts (runner/models/moe/balance.py): a chart
  each with a line per layer, what they mean, and their last values in the moe/ table."""
  run = make_run(tmp_path / "up", summary={"val/prec@1": 0.4, "moe/layer_1/max_violation": 0.25,
                                           "moe/layer_3/max_violation": 0.5,
                                           "moe/layer_1/dead_experts": 1.0})
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  with open(run / "metrics.jsonl", "w") as out:
    for record in records:
      for layer in (1, 3):
        record.update({f"moe/layer_{layer}/max_violation": 0.1 * layer + record["step"] / 100,
                       f"moe/layer_{layer}/dead_experts": 1.0,
                       f"moe/layer_{layer}/saturated_experts": float(record["step"] % 3)})
      out.write(json.dumps(record) + "\n")
  text = run_page.write_run_page(run).read_text()
  routing = text.split('<section id="routing">')[1].split("</section>")[0]
  for name in ("max_violation", "dead_experts", "saturated_experts"):
    assert f"moe/layer_*/{name}" in routing, name
  assert routing.count("balance per MoE layer, over the batch") == 3
  assert "MaxVio = (max_i load_i - mean load) / mean load" in routing
  assert ('<tr><td>max_violation</td><td class="num">0.2500</td><td class="num">0.5000</td>'
          in text)


def test_the_router_z_loss_is_charted_in_total_and_per_layer(tmp_path):
  """model.router.z_loss_weight > 0 logs train/z_loss (c_z times the layers' sum) and each
  layer's L_z (runner/models/moe/z_loss.py): a chart of each on the run's page."""
  run = make_run(tmp_path / "up")
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  with open(run / "metrics.jsonl", "w") as out:
    for record in records:
      record["train/z_loss"] = 0.001 * (4.0 + 1 / record["step"])
      for layer in (1, 3):
        record[f"moe/layer_{layer}/z_loss"] = 2.0 + layer / record["step"]
      out.write(json.dumps(record) + "\n")
  text = run_page.write_run_page(run).read_text()
  assert "train/z_loss" in text and "moe/layer_*/z_loss" in text


def test_started_from_links_the_origin_runs_page_relatively(tmp_path):
  up = make_run(tmp_path / "runs" / "up")
  down = make_run(tmp_path / "runs" / "down", stage="finetune",
                  config={"init": {"checkpoint": str(up)}, "plugins": []})
  released = make_run(tmp_path / "runs" / "other", stage="finetune",
                      config={"init": {"checkpoint": "vmoe_b16_imagenet21k"}})
  page = assert_offline(run_page.write_run_page(down).read_text())
  assert ("a", "href", "../up/report.html") in page.urls
  elsewhere = run_page.write_run_page(down, tmp_path / "pages" / "down.html").read_text()
  assert ("a", "href", "../runs/up/report.html") in _Page(elsewhere).urls
  text = run_page.write_run_page(released).read_text()
  assert "vmoe_b16_imagenet21k" in text and "report.html" not in text


def test_downsampling_keeps_means_and_at_most_2000_points():
  steps = np.arange(1, 10_001, dtype=float)
  curve = curves.Curve(steps, np.sin(steps / 100))
  small = curves.downsample(curve)
  assert len(small) <= curves.MAX_POINTS and small.bucket == 5
  np.testing.assert_allclose(small.values[:3], [np.sin(steps[i:i + 5] / 100).mean()
                                                for i in (0, 5, 10)])
  np.testing.assert_allclose(small.steps[0], 3.0)
  matrix = curves.downsample(curves.Curve(steps, np.ones((10_000, 4))))
  assert matrix.values.shape == (2000, 4) and np.all(matrix.values == 1)
  short = curves.Curve(steps[:50], np.zeros(50))
  assert curves.downsample(short) is short


def test_a_10000_step_run_stays_under_10_mb_and_says_it_is_downsampled(tmp_path, monkeypatch):
  drawn = {"lines": [], "heatmaps": [], "writes": 0}  # what the page plots, and how often saved
  lines, heatmap, write = run_page.plots.lines, run_page.plots.heatmap, run_page.write_atomically

  def counted_lines(title, series, *args, **kwargs):
    drawn["lines"] += [len(steps) for _, steps, _ in series]
    return lines(title, series, *args, **kwargs)

  def counted_heatmap(title, steps, matrix, *args, **kwargs):
    drawn["heatmaps"].append(np.shape(matrix))
    return heatmap(title, steps, matrix, *args, **kwargs)

  def counted_write(target, text):
    drawn["writes"] += 1
    return write(target, text)

  monkeypatch.setattr(run_page.plots, "lines", counted_lines)
  monkeypatch.setattr(run_page.plots, "heatmap", counted_heatmap)
  monkeypatch.setattr(run_page, "write_atomically", counted_write)
  run = make_run(tmp_path / "long", steps=10_000, layers=(1, 3, 5), experts=32)
  text = run_page.write_run_page(run).read_text()
  size = (run / "report.html").stat().st_size
  assert size <= 10_000_000, size
  assert "at most 2,000 points per curve" in text and "buckets of up to 5" in text
  assert text.count("logged steps x experts") == 3
  # The page's work is bounded by what it draws, not by the run's length: every curve and heat
  # map is the 10,000 logged steps in 2,000 buckets of 5, and the page is written once.
  assert drawn["lines"] and max(drawn["lines"]) == curves.MAX_POINTS == 2000
  assert drawn["heatmaps"] == [(2000, 32)] * 3
  assert drawn["writes"] == 1


def test_sweep_page_lists_every_job_marks_the_best_and_links_their_pages(tmp_path):
  root = tmp_path / "sweep"
  scores = {}
  for num, (lr, seed) in enumerate([(lr, s) for lr in ("0.001", "0.01") for s in (0, 1)]):
    score = {"0.001": 0.5, "0.01": 0.7}[lr] + 0.01 * seed
    scores[num] = score
    make_run(root / str(num), steps=6,
             overrides=(f"optim.lr={lr}", f"seed={seed}", "train.steps=6",
                        f"workdir={root}"),
             summary={"step": 6, "val/prec@1": score, "val/nll": 1 - score,
                      "test/prec@1": score - 0.02, "test/nll": 1.1 - score})
  (root / "multirun.yaml").write_text("hydra: {}\n")
  (root / "optimization_results.yaml").write_text(yaml.safe_dump(
      {"name": "optuna", "best_params": {"optim.lr": 0.01, "seed": 1}, "best_value": 0.71}))
  written = sweep_page.write_sweep_page(root)
  assert written[-1] == root / "report.html"
  assert {p.parent.name for p in written[:-1]} == {"0", "1", "2", "3"}
  text = (root / "report.html").read_text()
  page = assert_offline(text)
  for heading in ("Jobs", "Best job", "Swept keys against the main metric",
                  "Mean ± std over seeds", "Optuna search"):
    assert heading in page.headings, heading
  links = [url for tag, name, url in page.urls if tag == "a" and not url.startswith("#")]
  for num in range(4):
    assert f"{num}/report.html" in links
  rows = [row.split("</tr>")[0] for row in text.split("<tr")[1:]]
  rows = [row for row in rows if "report.html" in row]
  assert len(rows) == 4  # a row per job
  for num, row in enumerate(rows[:4]):
    lr, seed = ("0.001", "0.01")[num // 2], num % 2
    assert f"<td>{lr}</td>" in row or f'<td class="num">{lr}</td>' in row
    assert f'<td class="num">{seed}</td>' in row
  best = max(scores, key=scores.get)
  assert 'class="best"' in rows[best] and "★ best" in rows[best]
  assert sum("★ best" in row for row in rows) == 1
  # The seeds' table is vmoe summarize's own.
  jobs = summarize.find_jobs(root)
  _, body = summarize.sweep_table(jobs, summarize.default_columns(jobs))
  for row in body:
    assert all(str(cell) in text for cell in row)
  assert "best value: <b>0.71</b>" in text and "the trial's job" in text
  assert text.count("<svg") == 2  # optim.lr and seed against the main metric
  assert "train.steps=6" in text  # the overrides every job shares
  assert ("a", "href", "../report.html") in _Page((root / "0" / "report.html").read_text()).urls


def test_a_chain_of_stages_lists_them_in_the_order_they_ran_linked(tmp_path, run_cli):
  """A folder of named runs (the demo's runs/demo): a row per stage, after the stage it started
  from even when the clock says otherwise, each linking its page and its origin's."""
  root = tmp_path / "demo"
  up = make_run(root / "pretrain", summary={"val/prec@1": 0.73, "step": 12})
  down = make_run(root / "finetune", stage="finetune", summary={"val/prec@1": 0.78, "step": 12},
                  config={"init": {"checkpoint": str(up)}})
  ev = make_run(root / "eval", stage="eval", summary={"uci_digits/prec@1": 0.77},
                config={"init": {"checkpoint": str(down)}})
  for run, started in ((up, "12:00:00"), (down, "11:00:00"), (ev, "10:00:00")):  # a wrong clock
    text = (run / LOCK_FILE).read_text().replace("10:00:00", started)
    (run / LOCK_FILE).write_text(text)
  code, out, err = run_cli("report", str(root))
  assert code == 0, err
  assert out.split() == [str(up / "report.html"), str(down / "report.html"),
                         str(ev / "report.html"), str(root / "report.html")]
  text = (root / "report.html").read_text()
  page = assert_offline(text)
  assert page.sections == ["stages"]
  links = [url for tag, name, url in page.urls if tag == "a" and url.endswith("report.html")]
  assert links == ["pretrain/report.html", "finetune/report.html", "pretrain/report.html",
                   "eval/report.html", "finetune/report.html"]
  for metric in ("0.7300", "0.7800", "0.7700"):
    assert f'<td class="num">{metric}</td>' in text


@pytest.mark.parametrize("what", ["missing", "file", "empty", "neither", "one bad of two"])
def test_bad_paths_exit_2_with_one_paragraph_and_write_nothing(tmp_path, run_cli, what):
  good = make_run(tmp_path / "good")
  bad = tmp_path / "bad"
  if what == "file":
    bad.write_text("not a run")
  elif what == "empty":
    bad.mkdir()
  elif what == "neither":
    (bad / "notes").mkdir(parents=True)
    (bad / "README.txt").write_text("hello")
  args = [str(good), str(bad)] if what == "one bad of two" else [str(bad)]
  code, out, err = run_cli("report", *args)
  assert code == 2, (code, out, err)
  assert "Traceback" not in err and not out
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"vmoe report: error: {bad} "), err
  assert "summary.json" in err and "sweep" in err
  assert not list(tmp_path.rglob("report.html"))


def test_the_command_prints_each_page_it_writes(tmp_path, run_cli):
  run = make_run(tmp_path / "up")
  make_run(tmp_path / "sweep" / "0", summary={"val/prec@1": 0.5})
  code, out, err = run_cli("report", str(run), str(tmp_path / "sweep"))
  assert code == 0, err
  assert out.split() == [str(run / "report.html"), str(tmp_path / "sweep" / "0" / "report.html"),
                         str(tmp_path / "sweep" / "report.html")]
  code, out, err = run_cli("report", str(run), "--out", str(tmp_path / "page.html"))
  assert code == 0 and out.strip() == str(tmp_path / "page.html")
  code, _, err = run_cli("report", str(run), str(run), "--out", str(tmp_path / "x.html"))
  assert code == 2 and "--out names one page" in err


def _training_section(text: str) -> str:
  return text.split('<section id="training">')[1].split("</section>")[0]


def test_a_short_training_run_shows_its_one_logged_point_and_how_to_get_curves(tmp_path):
  """train.steps=20 with train.log_every_steps=20: the stage logs training once, at its last
  step (runner/train/loop.py), and the page says so rather than calling it a stage that does not
  train."""
  run = make_run(tmp_path / "short", steps=20,
                 config={"seed": 0, "train": {"steps": 20, "log_every_steps": 20}})
  last = (run / "metrics.jsonl").read_text().splitlines()[-1]  # the record of step 20
  (run / "metrics.jsonl").write_text(last + "\n")
  section = _training_section(run_page.write_run_page(run).read_text())
  assert "Nothing was logged over training steps" not in section
  assert ("Training logged once, at step 20 (train.log_every_steps=20 over train.steps=20)"
          in section)
  assert "e.g. train.log_every_steps=2: 10 points" in section
  loss = json.loads(last)["train/loss"]
  assert f'<tr><td>train/loss</td><td class="num">20</td><td class="num">{loss:.4f}</td></tr>' \
      in section
  assert "<td>moe/layer_3/load_loss</td>" in section and "<td>val/loss</td>" not in section
  # Still before its first logging step (fewer steps done than one log interval): none yet.
  (run / "metrics.jsonl").write_text("")
  (run / "summary.json").unlink()
  (run / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 10,
                                                              "log_every_steps": 20}}))
  section = _training_section(run_page.write_run_page(run).read_text())
  assert "Nothing was logged over training steps" not in section
  assert "No training step was logged (train.log_every_steps=20 over train.steps=10)" in section
  # A stage that does not train logs its metrics once, as the page says.
  ev = make_run(tmp_path / "eval", stage="eval", summary={"uci_digits/prec@1": 0.77})
  (ev / "metrics.jsonl").write_text(json.dumps({"step": 0, "uci_digits/prec@1": 0.77}) + "\n")
  section = _training_section(run_page.write_run_page(ev).read_text())
  assert "Nothing was logged over training steps (an eval, few-shot or ensemble" in section


def _no_page_but(root: pathlib.Path, *kept: pathlib.Path) -> None:
  assert sorted(root.rglob("report.html")) == sorted(kept)


def test_out_replaces_an_earlier_page_and_nothing_else(tmp_path, run_cli):
  run = make_run(tmp_path / "up")
  config = (run / "config.yaml").read_text()
  err = fails_clearly(run_cli("report", str(run), "--out", str(run / "config.yaml")),
                      f"--out {run / 'config.yaml'} is a file vmoe report did not write",
                      "Give --out a path that does not exist yet", "remove that file")
  assert (run / "config.yaml").read_text() == config
  fails_clearly(run_cli("report", str(run), "--out", str(tmp_path)),
                f"--out {tmp_path} is a folder", "names the page's file",
                str(tmp_path / "report.html"), "leave --out out")
  _no_page_but(tmp_path)
  assert not list(tmp_path.rglob(".report-*"))  # no temporary file left either
  # A page vmoe wrote is replaced, and so is one written before pages carried the marker.
  page = tmp_path / "pages" / "up.html"
  assert run_cli("report", str(run), "--out", str(page))[0] == 0
  assert markup.GENERATOR in page.read_text()
  page.write_text(page.read_text().replace(markup.GENERATOR + "\n", "").replace("val/", "old/"))
  code, out, err = run_cli("report", str(run), "--out", str(page))
  assert code == 0 and out.strip() == str(page), err
  assert "val/" in page.read_text()


def test_a_page_in_its_folder_replaces_only_a_page(tmp_path, run_cli):
  """A run's, a sweep job's and a chain's own report.html that vmoe did not write stop the
  command before it writes anything, for every path given."""
  other = make_run(tmp_path / "other")
  run = make_run(tmp_path / "up")
  (run / "report.html").write_text("<html>my notes</html>")
  fails_clearly(run_cli("report", str(other), str(run)),
                f"{run / 'report.html'} is a file vmoe report did not write",
                "Move or remove that file")
  assert (run / "report.html").read_text() == "<html>my notes</html>"
  _no_page_but(tmp_path, run / "report.html")
  (run / "report.html").unlink()
  (run / "report.html").mkdir()
  fails_clearly(run_cli("report", str(run)), f"{run / 'report.html'} is a folder")
  sweep = tmp_path / "sweep"
  for num in range(2):
    make_run(sweep / str(num), summary={"val/prec@1": 0.5 + num})
  (sweep / "1" / "report.html").write_text("job 1's notes")
  fails_clearly(run_cli("report", str(sweep)), f"{sweep / '1' / 'report.html'} is a file")
  _no_page_but(sweep, sweep / "1" / "report.html")
  (sweep / "1" / "report.html").unlink()
  assert run_cli("report", str(sweep))[0] == 0  # and again over the pages it wrote
  assert run_cli("report", str(sweep))[0] == 0
  chain = tmp_path / "demo"
  make_run(chain / "pretrain")
  (chain / "report.html").write_text("the demo's notes")
  fails_clearly(run_cli("report", str(chain)), f"{chain / 'report.html'} is a file")
  _no_page_but(chain, chain / "report.html")


def test_summarize_leaves_a_report_html_it_did_not_write(tmp_path, run_cli):
  """The table as ever; the sweep's pages not written, a warning naming the file."""
  for num in range(2):
    make_run(tmp_path / str(num), summary={"val/prec@1": 0.5 + 0.1 * num, "val/nll": 1.0})
  (tmp_path / "report.html").write_text("notes")
  code, out, err = run_cli("summarize", str(tmp_path), "--no-plots")
  assert code == 0, err
  assert (tmp_path / "summary.md").read_text() in out
  assert err.startswith("vmoe summarize: warning: the sweep's pages were not written: "
                        f"{tmp_path / 'report.html'} is a file vmoe report did not write")
  assert (tmp_path / "report.html").read_text() == "notes"
  _no_page_but(tmp_path, tmp_path / "report.html")


def _hold_lock(workdir: pathlib.Path) -> subprocess.Popen:
  code = textwrap.dedent(f"""
      import time
      from runner.workdirs.workdir_lock import WorkdirLock
      with WorkdirLock({str(workdir)!r}, "vmoe pretrain workdir=held"):
        time.sleep(120)
  """)
  holder = subprocess.Popen([sys.executable, "-c", code],
                            cwd=pathlib.Path(__file__).parents[2])
  deadline = time.monotonic() + 60
  while f"pid {holder.pid} " not in (workdir / LOCK_FILE).read_text():
    assert holder.poll() is None and time.monotonic() < deadline, "the holder never locked"
    time.sleep(0.05)
  return holder


def test_a_live_run_gets_the_in_progress_banner(tmp_path):
  run = make_run(tmp_path / "up")
  holder = _hold_lock(run)
  try:
    text = run_page.write_run_page(run).read_text()
    assert 'class="banner"' in text and "In progress" in text
    assert f"pid {holder.pid}" in text
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert "In progress" not in run_page.write_run_page(run).read_text()
  # The lock of this very process (a stage writing its own page as it ends) is no live run.
  with WorkdirLock(str(run), "vmoe pretrain workdir=up"):
    assert "In progress" not in run_page.write_run_page(run).read_text()
  # The probe changes nothing in the lock file: the last holder stays on record.
  assert "vmoe pretrain workdir=up" in (run / LOCK_FILE).read_text()


def test_an_evaluator_adds_its_own_section(tmp_path, monkeypatch):
  run = make_run(tmp_path / "up")
  evaluator = suite.EVALUATORS.get("classification")
  assert evaluator.report_section({}, run) is None  # the base class's default

  def section(cls, summary, workdir):
    return ("Per-class <accuracy>", f"<p>{len(summary)} keys in {workdir.name}</p>")
  monkeypatch.setattr(evaluator, "report_section", classmethod(section))
  text = run_page.write_run_page(run).read_text()
  page = _Page(text)
  assert "evaluator-classification" in page.sections
  assert "Per-class <accuracy>" in page.headings and "Per-class &lt;accuracy&gt;" in text
  keys = len(json.loads((run / "summary.json").read_text()))
  assert f"<p>{keys} keys in up</p>" in text

  def broken(cls, summary, workdir):
    raise RuntimeError("boom")
  monkeypatch.setattr(evaluator, "report_section", classmethod(broken))
  text = run_page.write_run_page(run).read_text()
  assert "report_section failed: RuntimeError: boom" in text


def test_a_stage_with_wandb_gets_the_pages_heat_maps_and_tables(tmp_path, monkeypatch, capfd):
  """The heat map of each MoE layer as a W&B image and the final metrics and checkpoints as W&B
  tables, in the run's own (resumed, offline) W&B run; nothing without W&B."""
  import wandb

  from runner.report import wandb_media
  monkeypatch.delenv("WANDB_MODE", raising=False)  # conftest disables W&B for other tests
  for var in ("HOME", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR"):
    monkeypatch.setenv(var, str(tmp_path / var.lower()))
  wandb.teardown()
  try:
    off = make_run(tmp_path / "off", config={"logger": {"wandb": {"mode": "disabled"}}})
    (off / "wandb_run_id").write_text("old123")  # W&B on in an earlier attempt, off now
    assert wandb_media.publish(off) == []
    run = make_run(tmp_path / "up", config={"seed": 0, "logger": {"wandb": {"mode": "offline"}}})
    (run / "wandb_run_id").write_text("abc123")
    logged = wandb_media.publish(run)
    # An online stage that fell back to offline (no key, no server) logs its pictures offline
    # too, without trying the server again (which would warn again).
    fell_back = make_run(tmp_path / "fell_back",
                         config={"seed": 0, "logger": {"wandb": {"mode": "online"}}})
    (fell_back / "wandb_run_id").write_text("def456")
    (fell_back / "wandb" / "offline-run-20261126_100000-def456").mkdir(parents=True)
    capfd.readouterr()
    assert "report/final_metrics" in wandb_media.publish(fell_back)
    assert "warning" not in capfd.readouterr().err.lower()
  finally:
    wandb.teardown()
  assert logged == ["moe/layer_1/expert_load_map", "moe/layer_3/expert_load_map",
                    "report/final_metrics", "report/checkpoints"]
  files = next((run / "wandb").glob("offline-run-*-abc123")) / "files" / "media"
  for layer in (1, 3):
    image = next((files / "images" / "moe" / f"layer_{layer}").glob("expert_load_map_*.png"))
    assert image.read_bytes()[:4] == b"\x89PNG"
  table = json.loads(next((files / "table" / "report").glob("final_metrics_*.table.json"))
                     .read_text())
  assert table["columns"] == ["section", "metric", "value"]
  assert ["val", "prec@1", "0.4200"] in table["data"]
  assert not list(run.glob("*expert_load*.png"))  # the page's pictures stay the evaluators'
