"""`vmoe fewshot` end to end on tiny checkpoints, its bad inputs, and few-shot during training."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import yaml

from conftest import QUIET, TINY_MODEL

from runner.checkpoints import checkpoint
from runner.evaluators import fewshot_math

pytestmark = pytest.mark.xdist_group("fewshot")

FAST = [*QUIET, "fewshot.shots=[1,5]", "fewshot.seeds=[0]"]


def _lines(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


# A ViT pretrained with few-shot evaluation every 2 of its 4 steps; also the second extractor.
VIT_FEWSHOT = ["model=vit_tiny", *TINY_MODEL, *FAST, "train.steps=4", "schedule.warmup_steps=0",
               "data.batch_size=16",
               "fewshot.every_steps=2", "fewshot.datasets=[uci_digits]"]


@pytest.fixture(scope="module")
def vmoe_run(shared_run):
  """A tiny V-MoE pretrained 2 steps (the session's shared run: read, never written)."""
  return shared_run("vmoe_2steps")


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
  from runner import cli
  workdir = tmp_path_factory.mktemp("fs_vit") / "run"
  assert cli.main(["pretrain", f"workdir={workdir}", *VIT_FEWSHOT, "train.log_every_steps=2",
                   "checkpoint.every_steps=2"]) == 0
  return workdir


def _fails_clearly(result, *expected):
  code, out, err = result
  assert code == 2, (code, out, err)
  assert "Traceback" not in err and "Traceback" not in out
  assert len(err.strip().splitlines()) == 1, err
  for text in expected:
    assert text in err, (text, err)


def test_fewshot_writes_metrics_summary_plot_and_table(vmoe_run, tmp_path, run_cli):
  code, out, err = run_cli("fewshot", f"init.checkpoint={vmoe_run}", f"workdir={tmp_path}", *FAST,
                           "fewshot.datasets=[uci_digits,lfw_faces]", "model.router.k=1")
  assert code == 0, err
  summary = json.loads((tmp_path / "summary.json").read_text())
  for name in ("uci_digits", "lfw_faces", "mean"):
    for shots in (1, 5):
      assert 0 <= summary[f"{name}/{shots}shot/accuracy"] <= 1
  assert summary["checkpoint_step"] == 2 and summary["uci_digits/num_classes"] == 10
  assert summary["lfw_faces/train_split"] == "train[:98]"  # the slice left after the held-out part
  assert summary["uci_digits/test_split"] == "test"
  (record,) = _lines(tmp_path / "metrics.jsonl")
  assert record["step"] == 2 and "mean/5shot/accuracy" in record and "mean/5shot/l2_reg" in record
  config = yaml.safe_load((tmp_path / "config.yaml").read_text())
  (member,) = config["members"]
  assert member["model"]["router"]["k"] == 1 and member["model"]["name"] == "vmoe_tiny"
  assert config["data"]["pp"] == "decode(3)|resize(16)|value_range(-1,1)"
  assert (tmp_path / "fewshot_accuracy.png").read_bytes()[:4] == b"\x89PNG"
  lines = out.strip().splitlines()  # after any dataset preparation messages
  table = lines[next(i for i, line in enumerate(lines) if line.startswith("dataset ")):]
  assert table[0].split() == ["dataset", "1-shot", "5-shot"]
  assert [row.split()[0] for row in table[1:]] == ["uci_digits", "lfw_faces", "mean"]


def test_two_checkpoints_concatenate_their_features(vmoe_run, vit_run, tmp_path, run_cli,
                                                    monkeypatch):
  probed = {}  # dataset -> (train features, test features) the ridge classifiers are given
  fit = fewshot_math.fewshot_metrics

  def spy(features, *args, **kwargs):
    probed.update({name: (f[0], f[2]) for name, f in features.items()})
    return fit(features, *args, **kwargs)

  monkeypatch.setattr(fewshot_math, "fewshot_metrics", spy)
  code, out, err = run_cli("fewshot", f"init.checkpoint=[{vmoe_run},{vit_run}]",
                           f"workdir={tmp_path}", *FAST, "fewshot.datasets=[uci_digits]")
  assert code == 0, err
  # A member's pre-logit width is what its head reads: the rows of its head kernel.
  widths = [checkpoint.param_shapes(str(run))["head"]["kernel"][0] for run in (vmoe_run, vit_run)]
  train, test = probed["uci_digits"]
  assert train.shape[1] == test.shape[1] == sum(widths)
  assert not np.allclose(test[:, :widths[0]], test[:, widths[0]:])  # two members, not one twice
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["checkpoint"] == [str(vmoe_run), str(vit_run)]
  assert summary["checkpoint_step"] == [2, 4]
  assert 0 <= summary["uci_digits/5shot/accuracy"] <= 1
  config = yaml.safe_load((tmp_path / "config.yaml").read_text())
  assert [m["model"]["name"] for m in config["members"]] == ["vmoe_tiny", "vit_tiny"]


@pytest.mark.parametrize("args, expected", [
    ([], ["needs init.checkpoint"]),
    (["CKPT", "fewshot.datasets=[lfw_faces]", "fewshot.shots=[1,60]"],
     ["'lfw_faces'", "49 examples", "60 shots", "at most 49 shots"]),
    (["CKPT", "fewshot.datasets=[no_such_dataset]"],
     ["unknown dataset 'no_such_dataset'", "mnist5k"]),
    (["CKPT", "fewshot.datasets=[]"], ["fewshot.datasets is empty"]),
    (["CKPT", "fewshot.datasets=[uci_digits:nosplit]"], ["no split 'nosplit'", "validation"]),
    (["CKPT", "fewshot.test_split='test[5:5]'"], ["split 'test[5:5]'", "is empty"]),
    (["CKPT", "model.router.k=9"], ["model.router.k=9"]),
    (["init.checkpoint=/no/such/run"], ["does not exist"]),
])
def test_bad_input_fails_before_compute(args, expected, vmoe_run, tmp_path, run_cli):
  args = [f"init.checkpoint={vmoe_run}" if a == "CKPT" else a for a in args]
  _fails_clearly(run_cli("fewshot", f"workdir={tmp_path}", *QUIET, *args), *expected)
  assert not (tmp_path / "summary.json").exists() and not (tmp_path / "config.yaml").exists()


def test_pretrain_with_fewshot_every_steps(vit_run, run_cli):
  records = [r for r in _lines(vit_run / "metrics.jsonl") if "fewshot/mean/5shot/accuracy" in r]
  assert [r["step"] for r in records] == [2, 4]
  for r in records:
    assert 0 <= r["fewshot/uci_digits/1shot/accuracy"] <= 1 and "fewshot/mean/1shot/l2_reg" in r
  summary = json.loads((vit_run / "summary.json").read_text())
  assert "fewshot/uci_digits/5shot/accuracy" in summary and "val/prec@1" in summary
  steps = sorted(int(p.name) for p in (vit_run / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [2, 4]

  # A rerun resumes the finished run: no training step, the final evaluations again.
  before = len(_lines(vit_run / "metrics.jsonl"))
  code, _, err = run_cli("pretrain", f"workdir={vit_run}", *VIT_FEWSHOT)
  assert code == 0, err
  after = _lines(vit_run / "metrics.jsonl")[before:]
  assert all("train/loss" not in r for r in after)
  assert any("fewshot/mean/5shot/accuracy" in r for r in after)


def test_training_with_impossible_shots_fails_before_training(tmp_path, run_cli):
  _fails_clearly(run_cli("pretrain", f"workdir={tmp_path}", *TINY_MODEL, *QUIET, "train.steps=1",
                         "schedule.warmup_steps=0",
                         "data.batch_size=16", "fewshot.every_steps=1",
                         "fewshot.datasets=[lfw_faces]", "fewshot.shots=[50]"),
                 "'lfw_faces'", "50 shots")
  assert not (tmp_path / "checkpoints").exists()
