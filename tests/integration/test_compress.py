"""`vmoe compress` through the CLI: what it writes (E' experts per MoE layer, made as its summary's
groups say from the source's experts, the statistics it used, a picture), that every later stage
takes the folder as a run, and what it refuses before writing anything. The methods' math is
tested against the papers' definitions in tests/unit/test_compression.py; a released E³
checkpoint compresses in tests/integration/test_released_checkpoints.py."""
from __future__ import annotations

import contextlib
import io
import json
import pathlib
import shutil

import numpy as np
import pytest
from conftest import QUIET, fails_clearly, nothing_like_a_run

from runner import cli
from runner.checkpoints import checkpoint, weights
from runner.models import transfer

pytestmark = pytest.mark.xdist_group("compress")

SMALL = ["compress.examples=64", "data.eval_batch_size=32"]


def _summary(workdir: pathlib.Path) -> dict:
  return json.loads((workdir / "summary.json").read_text())


def _experts(path) -> dict[str, np.ndarray]:
  flat = transfer.flatten(weights.load(str(path))[0])
  return {k.split("/", 2)[2]: v for k, v in flat.items() if k.startswith("block_1/moe/")}


@pytest.fixture(scope="module")
def merged(shared_run, tmp_path_factory) -> pathlib.Path:
  """The shared tiny V-MoE (8 experts on block 1) merged into 4."""
  out = tmp_path_factory.mktemp("compress") / "merged"
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert cli.main(["compress", f"init.checkpoint={shared_run('vmoe_2steps')}",
                     "compress.method=merge", "compress.experts=4", *SMALL, f"workdir={out}",
                     *[q for q in QUIET if not q.startswith("logger.report")]]) == 0
  assert "merge 8 -> 4 experts" in printed.getvalue()
  assert "model.moe.num_experts=4" in printed.getvalue()  # what a fine-tune of it needs
  return out


def test_merge_averages_each_group_by_how_often_its_experts_were_chosen(shared_run, merged):
  summary, source, new = _summary(merged), _experts(shared_run("vmoe_2steps")), _experts(merged)
  new_expert = summary["compress/layer_1/new_expert"]  # each old expert's
  assert sorted(set(new_expert)) == [0, 1, 2, 3]  # merging keeps every expert, in 4 groups
  groups = [[e for e in range(8) if new_expert[e] == j] for j in range(4)]
  chosen = np.array(summary["compress/layer_1/chosen"])
  assert new["experts/fc1_kernel"].shape == (4, 32, 64)
  assert new["router/dense/kernel"].shape == (32, 4)
  for j, group in enumerate(groups):
    f = chosen[group] / chosen[group].sum()
    np.testing.assert_allclose(new["experts/fc2_kernel"][j],
                               np.tensordot(f, source["experts/fc2_kernel"][group], 1), atol=1e-6)
    np.testing.assert_allclose(new["router/dense/kernel"][:, j],
                               source["router/dense/kernel"][:, group] @ f, atol=1e-6)
  assert chosen.sum() == 2 * summary["compress/layer_1/tokens"]  # k = 2 choices per token
  assert summary["compress/calibration_images"] == 64
  assert summary["compress/parameters"] < summary["compress/parameters_before"]
  assert 0 <= summary["calibration/prec@1"] <= 1 and 0 <= summary["calibration/prec@1_before"] <= 1
  stored = checkpoint.read_config(str(merged))
  assert stored["model"]["moe"]["num_experts"] == 4 and stored["stage"] == "compress"
  assert (merged / "compressed_experts.png").stat().st_size > 0
  page = (merged / "report.html").read_text()
  assert "vmoe compress" in page and "compressed_experts.png" in page


def test_every_later_stage_takes_the_compressed_run(shared_run, merged, run_cli, tmp_path):
  """eval of the compressed run on its calibration images gives the calibration precision@1
  compress measured (the same images, batches and routing groups), and so does eval of the source
  for the precision before; the other stages run."""
  same = ["eval.corruptions=[]", "eval.ood_datasets=[]", "eval.capacity_sweep=[]",
          "eval.split='train[0:64]'", "data.eval_batch_size=32", *QUIET]
  for run, key in ((merged, "calibration/prec@1"),
                   (shared_run("vmoe_2steps"), "calibration/prec@1_before")):
    code, _, err = run_cli("eval", f"init.checkpoint={run}", *same, f"workdir={tmp_path / 'eval'}")
    assert code == 0, err
    assert _summary(tmp_path / "eval")["mnist5k/prec@1"] == pytest.approx(_summary(merged)[key])
  code, _, err = run_cli("finetune", f"init.checkpoint={merged}", "model.moe.num_experts=4",
                         "model.num_layers=2", "model.hidden_size=32", "model.mlp_dim=64",
                         "model.num_heads=2", "model.image_size=16", "train.steps=1",
                         "schedule.warmup_steps=0", "data.batch_size=16", *QUIET,
                         f"workdir={tmp_path / 'finetune'}")
  assert code == 0, err
  code, _, err = run_cli("fewshot", f"init.checkpoint={merged}", "fewshot.datasets=[uci_digits]",
                         "fewshot.shots=[1]", "fewshot.seeds=[0]", *QUIET,
                         f"workdir={tmp_path / 'fewshot'}")
  assert code == 0, err
  code, _, err = run_cli("ensemble", f"init.checkpoint=[{merged},{shared_run('vmoe_2steps')}]",
                         *QUIET, "eval.corruptions=[]", "eval.ood_datasets=[]",
                         "eval.capacity_sweep=[]", f"workdir={tmp_path / 'ensemble'}")
  assert code == 0, err
  assert _summary(tmp_path / "ensemble")["ensemble/size"] == 2
  code, _, err = run_cli("export", f"init.checkpoint={merged}", *QUIET,
                         f"workdir={tmp_path / 'export'}")
  assert code == 0, err
  assert _summary(tmp_path / "export")["export/parameters"] == _summary(merged)["compress/parameters"]


def test_prune_keeps_experts_as_they_were(shared_run, run_cli, tmp_path):
  """prune_frequency keeps the most chosen experts; prune (Lu et al.) the subset whose layer
  output is nearest the whole layer's, so no farther than the most chosen ones' on the same
  calibration images. Either way the kept experts and router columns are the source's."""
  source, before = shared_run("vmoe_2steps"), _experts(shared_run("vmoe_2steps"))
  errors = {}
  for method in ("prune_frequency", "prune"):
    code, _, err = run_cli("compress", f"init.checkpoint={source}", f"compress.method={method}",
                           "compress.experts=2", *SMALL, f"workdir={tmp_path / method}", *QUIET)
    assert code == 0, err
    summary, after = _summary(tmp_path / method), _experts(tmp_path / method)
    kept = [e for e, j in enumerate(summary["compress/layer_1/new_expert"]) if j >= 0]
    assert summary["compress/layer_1/new_expert"] == [kept.index(e) if e in kept else -1
                                                      for e in range(8)]
    for name in ("experts/fc1_kernel", "experts/fc1_bias", "experts/fc2_kernel",
                 "experts/fc2_bias"):
      np.testing.assert_array_equal(after[name], before[name][kept])
    np.testing.assert_array_equal(after["router/dense/kernel"],
                                  before["router/dense/kernel"][:, kept])
    errors[method] = summary["compress/layer_1/output_error"]
    if method == "prune_frequency":
      chosen, w = (np.array(summary[f"compress/layer_1/{k}"]) for k in ("chosen", "weights"))
      assert kept == sorted(sorted(range(8), key=lambda e: (-chosen[e], -w[e], e))[:2])
  assert errors["prune"] <= errors["prune_frequency"] + 1e-9


def test_compress_refuses_before_writing(shared_run, run_cli, tmp_path):
  out = tmp_path / "out"
  vmoe = shared_run("vmoe_2steps")
  unfinished = tmp_path / "unfinished"
  shutil.copytree(vmoe, unfinished)
  (unfinished / "summary.json").unlink()
  for args, expected in (
      ([f"init.checkpoint={vmoe}"], ("compress.experts=<E'>", "8")),
      ([f"init.checkpoint={vmoe}", "compress.experts=8"], ("fewer than the checkpoint's 8",)),
      ([f"init.checkpoint={vmoe}", "compress.experts=4", "compress.method=squash"],
       ("compress.method", "prune, prune_frequency, merge")),
      ([f"init.checkpoint={vmoe}", "compress.experts=0"], ("compress.experts",)),
      ([f"init.checkpoint={shared_run('softmoe_3steps')}", "compress.experts=2"],
       ("model.router.type=soft", "token-choice and experts-choice")),
      ([f"init.checkpoint={shared_run('vit_1step')}", "compress.experts=2"],
       ("dense ViT", "no experts")),
      ([f"init.checkpoint={vmoe}", "compress.experts=4", "data.eval_batch_size=12"],
       ("data.eval_batch_size=12", "model.moe.group_size=8")),
      ([f"init.checkpoint={unfinished}", "compress.experts=4"], ("did not finish",)),
      ([f"init.checkpoint={vmoe}", "compress.experts=4", "compress.split=nosuch"],
       ("compress.split=nosuch",)),
      ([f"init.checkpoint={vmoe}", "compress.experts=4", "data.name=mnist5k_0to4"],
       ("5 classes", "predicts 10"))):
    fails_clearly(run_cli("compress", *args, f"workdir={out}", *QUIET), *expected)
    nothing_like_a_run(out)


def test_shared_experts_are_kept_and_fine_grained_ones_compress(run_cli, tmp_path):
  """DeepSeekMoE's experts: 2 shared experts pass through whole; the router's 16 fine-grained
  experts (8 split in 2) merge into 6, which the stored model counts as 3 split in 2."""
  tiny = ["model.num_layers=2", "model.hidden_size=32", "model.mlp_dim=64", "model.num_heads=2",
          "model.image_size=16"]
  up = tmp_path / "up"
  code, _, err = run_cli("pretrain", "model=vmoe_tiny_k1_s2_f2", *tiny, *QUIET, "train.steps=1",
                         "schedule.warmup_steps=0", "data.batch_size=16", f"workdir={up}")
  assert code == 0, err
  code, _, err = run_cli("compress", f"init.checkpoint={up}", "compress.experts=6", *SMALL,
                         *QUIET, f"workdir={tmp_path / 'merged'}")
  assert code == 0, err
  before, after = _experts(up), _experts(tmp_path / "merged")
  assert after["experts/fc1_kernel"].shape[0] == 6 and before["experts/fc1_kernel"].shape[0] == 16
  for name in [n for n in before if n.startswith("shared/")]:
    np.testing.assert_array_equal(after[name], before[name])
  stored = checkpoint.read_config(str(tmp_path / "merged"))["model"]["moe"]
  assert (stored["num_experts"], stored["expert_split"], stored["shared_experts"]) == (3, 2, 2)
  out = tmp_path / "refused"
  fails_clearly(run_cli("compress", f"init.checkpoint={up}", "compress.experts=5", *QUIET,
                        f"workdir={out}"), "compress.experts=5", "multiple of 2", "expert_split=2")
  fails_clearly(run_cli("compress", f"init.checkpoint={up}", "compress.experts=8",
                        "compress.method=prune", *QUIET, f"workdir={out}"),
                "12,870 subsets", "prune_frequency")
  nothing_like_a_run(out)
