"""Every subcommand end to end on tiny configs, through the real CLI entry point."""
from __future__ import annotations

import json
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest
import yaml

from conftest import QUIET, TINY_MODEL

pytestmark = pytest.mark.xdist_group("e2e")


def _lines(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A tiny V-MoE pretrained for 4 steps on the embedded upstream data."""
  from runner import cli
  workdir = tmp_path_factory.mktemp("up") / "run"
  code = cli.main(["pretrain", f"workdir={workdir}", *TINY_MODEL, *QUIET, "train.steps=4",
                   "schedule.warmup_steps=0",
                   "train.log_every_steps=2", "eval.every_steps=2", "checkpoint.every_steps=2",
                   "data.batch_size=16"])
  assert code == 0
  return workdir


def test_pretrain_writes_metrics_summary_config_and_checkpoints(pretrained):
  records = _lines(pretrained / "metrics.jsonl")
  train = [r for r in records if "train/loss" in r]
  val = [r for r in records if "val/prec@1" in r]
  assert [r["step"] for r in train] == [2, 4]
  assert [r["step"] for r in val] == [2, 4]
  for r in train:
    assert np.isfinite(r["train/loss"]) and r["train/lr"] > 0
    assert "moe/layer_1/importance_loss" in r and len(r["moe/layer_1/expert_load"]) == 8
    assert np.isfinite(r["moe/layer_1/max_violation"]) and 0 <= r["moe/layer_1/dead_experts"] <= 8
  assert 0 <= val[-1]["val/prec@1"] <= 1 and val[-1]["val/nll"] > 0
  summary = json.loads((pretrained / "summary.json").read_text())
  assert summary["step"] == 4
  for key in ("val/prec@1", "val/nll", "test/prec@1", "test/nll", "train/loss", "params/total"):
    assert key in summary
  config = yaml.safe_load((pretrained / "config.yaml").read_text())
  assert config["model"]["name"] == "vmoe_tiny" and config["data"]["name"] == "mnist5k"
  ran_on = json.loads((pretrained / "environment.json").read_text())  # what it ran on
  assert ran_on["packages"]["jax"] == jax.__version__ and ran_on["processes"] == 1
  assert ran_on["devices"].startswith(f"{jax.device_count()} x ")
  steps = sorted(int(p.name) for p in (pretrained / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [2, 4]
  for item in ("params", "opt_state", "meta", "config"):
    assert (pretrained / "checkpoints" / "4" / item).exists()


def test_rerun_of_a_finished_run_resumes_without_training(pretrained, tmp_path, run_cli):
  # A copy: the rerun appends to its metrics, which the shared run's other tests read as written.
  run = tmp_path / "run"
  shutil.copytree(pretrained, run)
  before = (run / "metrics.jsonl").read_text()
  summary = json.loads((run / "summary.json").read_text())
  code, _, err = run_cli("pretrain", f"workdir={run}", *TINY_MODEL, *QUIET,
                         "train.steps=4", "schedule.warmup_steps=0", "data.batch_size=16")
  assert code == 0, err
  after = _lines(run / "metrics.jsonl")[len(before.splitlines()):]
  assert all("train/loss" not in r for r in after)  # no step was trained again
  assert any("val/prec@1" in r for r in after)
  assert (pretrained / "metrics.jsonl").read_text() == before  # the shared run is untouched
  # The summary still reports the last training metrics, as the first run's did: the train/ ones
  # and the MoE layers' moe/ ones logged with them; no key is lost.
  rerun = json.loads((run / "summary.json").read_text())
  assert set(rerun) == set(summary)
  train = {k: v for k, v in summary.items() if k.startswith(("train/", "moe/"))}
  assert any(k.startswith("moe/") for k in train) and any(k.startswith("train/") for k in train)
  assert {k: rerun.get(k) for k in train} == train


def test_finetune_from_pretrain_then_eval(pretrained, tmp_path, run_cli):
  down = tmp_path / "down"
  code, _, err = run_cli("finetune", f"workdir={down}", f"init.checkpoint={pretrained}",
                         *TINY_MODEL, *QUIET, "train.steps=3", "schedule.warmup_steps=2",
                         "data.batch_size=16")
  assert code == 0, err
  # A warm-up that is most of the run still peaks and decays: said in one line, as it starts.
  assert ("warning: schedule.warmup_steps=2 is 67% of the run (train.steps=3), leaving 1 step "
          "of schedule=cosine after it") in err
  summary = json.loads((down / "summary.json").read_text())
  assert summary["step"] == 3 and "val/prec@1" in summary
  assert yaml.safe_load((down / "config.yaml").read_text())["data"]["name"] == "uci_digits"

  code, out, err = run_cli("eval", f"init.checkpoint={down}", f"workdir={tmp_path / 'ev'}", *QUIET)
  assert code == 0, err
  ev = json.loads((tmp_path / "ev" / "summary.json").read_text())
  assert ev["split"] == "test" and ev["checkpoint_step"] == 3
  assert 0 <= ev["uci_digits/prec@1"] <= 1 and ev["uci_digits/nll"] > 0
  assert "uci_digits/prec@1" in out

  # Inference-time routing: a small capacity with Batch Prioritized Routing drops many tokens.
  code, _, err = run_cli("eval", f"init.checkpoint={down}", f"workdir={tmp_path / 'ev_bpr'}",
                         *QUIET, "model.router.capacity_ratio=0.1",
                         "model.router.batch_priority=true", "model.router.k=1")
  assert code == 0, err
  low = json.loads((tmp_path / "ev_bpr" / "summary.json").read_text())
  key = "uci_digits/moe/layer_1/fraction_dropped_tokens"
  assert low[key] > ev[key] and low[key] > 0.5
  stored = yaml.safe_load((tmp_path / "ev_bpr" / "config.yaml").read_text())
  assert stored["model"]["router"] == {**stored["model"]["router"], "k": 1,
                                       "eval_capacity_ratio": 0.1, "batch_priority": True}


def test_sigmoid_gates_with_a_batch_balancing_loss_train_and_log_their_balance(tmp_path,
                                                                                 run_cli):
  """model.router.gate=sigmoid and balance_scope=batch train; every MoE layer logs MaxVio and its
  dead and saturated experts, which vmoe summarize tabulates."""
  workdir = tmp_path / "runs" / "sigmoid"
  code, _, err = run_cli("pretrain", f"workdir={workdir}", *TINY_MODEL, *QUIET, "train.steps=2",
                         "schedule.warmup_steps=0", "data.batch_size=16",
                         "model.router.gate=sigmoid", "model.router.balance_scope=batch")
  assert code == 0, err
  train = [r for r in _lines(workdir / "metrics.jsonl") if "train/loss" in r]
  assert train and np.isfinite(train[-1]["train/loss"])
  assert train[-1]["moe/layer_1/max_violation"] >= 0
  assert 0 <= train[-1]["moe/layer_1/saturated_experts"] <= 8
  code, out, err = run_cli("summarize", str(tmp_path / "runs"), "--no-plots", "--no-report")
  assert code == 0, err
  assert "MaxVio (worst layer) | dead experts | saturated experts" in out


def test_finetune_at_a_new_resolution_resizes_position_embeddings(pretrained, tmp_path, run_cli):
  tiny = [o for o in TINY_MODEL if not o.startswith("model.image_size")]
  code, _, err = run_cli("finetune", f"workdir={tmp_path}", f"init.checkpoint={pretrained}",
                         *tiny, "model.image_size=24", *QUIET, "train.steps=1",
                         "schedule.warmup_steps=0",
                         "data.batch_size=16")
  assert code == 0, err
  from runner.checkpoints import checkpoint
  shapes = checkpoint.param_shapes(str(tmp_path))
  assert shapes["pos_embedding"] == (1, 36, 32)  # (24 / 4)^2 patches


def test_vit_to_vmoe_upcycling_needs_dense_to_experts(shared_run, tmp_path, run_cli):
  dense = shared_run("vit_1step")  # a tiny ViT pretrained 1 step
  short = ["data.batch_size=16", "train.steps=1", "schedule.warmup_steps=0"]
  tiny_moe = [*TINY_MODEL, *QUIET, *short]
  code, _, err = run_cli("finetune", f"workdir={tmp_path / 'no'}", f"init.checkpoint={dense}",
                         *tiny_moe)
  assert code == 2
  assert "init.dense_to_experts=true" in err and "block_1/moe/experts/fc1_kernel" in err
  assert "Traceback" not in err
  code, _, err = run_cli("finetune", f"workdir={tmp_path / 'yes'}", f"init.checkpoint={dense}",
                         *tiny_moe, "init.dense_to_experts=true")
  assert code == 0, err


def test_multirun_gives_each_job_its_own_workdir(tmp_path, run_cli):
  # Overrides on both sides of the flag, as users type them (Hydra's parser takes them before).
  code, _, err = run_cli("pretrain", f"workdir={tmp_path}", "--multirun", "model=vit_tiny",
                         *TINY_MODEL, *QUIET, "train.steps=1", "schedule.warmup_steps=0",
                         "data.batch_size=16",
                         "optim.lr=1e-3,3e-3")
  assert code == 0, err
  lrs = sorted(yaml.safe_load((tmp_path / j / "config.yaml").read_text())["optim"]["lr"]
               for j in ("0", "1"))
  assert lrs == [1e-3, 3e-3]
  for j in ("0", "1"):
    assert (tmp_path / j / "summary.json").exists()
    assert (tmp_path / j / "checkpoints" / "1").exists()
    assert not (tmp_path / j / "report.html").exists()  # QUIET: logger.report=false


def test_a_sweeps_cfg_job_shows_every_job_and_runs_none(tmp_path, run_cli):
  code, out, err = run_cli("pretrain", "--multirun", f"workdir={tmp_path / 'sweep'}",
                           "optim.lr=1e-3,3e-3", "--cfg", "job", "seed=0,1", "train.steps=7",
                           "schedule.warmup_steps=0")
  assert code == 0, err
  headers = [line for line in out.splitlines() if line.startswith("# job ")]
  assert headers == ["# job 0 of 4: optim.lr=0.001 seed=0", "# job 1 of 4: optim.lr=0.001 seed=1",
                     "# job 2 of 4: optim.lr=0.003 seed=0", "# job 3 of 4: optim.lr=0.003 seed=1"]
  configs = [yaml.safe_load(part) for part in re.split(r"^# job .*$", out, flags=re.M)[1:]]
  assert [(c["optim"]["lr"], c["seed"], c["train"]["steps"]) for c in configs] == [
      (1e-3, 0, 7), (1e-3, 1, 7), (3e-3, 0, 7), (3e-3, 1, 7)]
  code, out, err = run_cli("pretrain", "--multirun", "hydra/sweeper=optuna", "--cfg", "job",
                           "optim.lr=tag(log,interval(1e-4,1e-1))")
  assert code == 0, err
  assert out.startswith("# hydra/sweeper=optuna searches: optim.lr=tag(log,interval(1e-4,1e-1))")
  assert not (tmp_path / "sweep").exists()


@pytest.mark.slow  # sweeps compose in test_config_compose; a multirun's workdirs just above
def test_finetune_lr_study_from_sweeps(pretrained, tmp_path, run_cli):
  code, _, err = run_cli("finetune", "-cd", "sweeps", "-cn", "finetune_lr", f"workdir={tmp_path}",
                         f"init.checkpoint={pretrained}", *TINY_MODEL, *QUIET, "train.steps=1",
                         "schedule.warmup_steps=0",
                         "data.batch_size=16")
  assert code == 0, err
  lrs = sorted(yaml.safe_load((tmp_path / str(j) / "config.yaml").read_text())["optim"]["lr"]
               for j in range(4))
  assert lrs == [0.001, 0.003, 0.01, 0.03]


def test_wandb_offline_run_is_written_in_the_workdir(tmp_path, run_cli):
  code, _, err = run_cli("pretrain", f"workdir={tmp_path}", "model=vit_tiny", *TINY_MODEL,
                         "logger.progress=false", "logger.wandb.mode=offline", "train.steps=1",
                         "schedule.warmup_steps=0",
                         "data.batch_size=16")
  assert code == 0, err
  # One W&B run: the stage's, then the same run resumed for the page's tables (an offline
  # resume is a folder of its own, with the same run id; `wandb sync` joins them).
  runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
  run_id = (tmp_path / "wandb_run_id").read_text().strip()
  assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
  assert all(any(r.glob("*.wandb")) for r in runs)
  assert any((runs[-1] / "files" / "media" / "table" / "report").glob("final_metrics_*.json"))
  # logger.report (default true): the stage ends by writing its vmoe report page, not in progress.
  page = (tmp_path / "report.html").read_text()
  assert "vmoe pretrain:" in page and "Training curves" in page and "In progress" not in page
