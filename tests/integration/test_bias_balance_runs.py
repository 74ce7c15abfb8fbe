"""Auxiliary-loss-free balancing through the CLI (model.router.balance=bias): a pretraining run
moves its routers' bias and adds no auxiliary loss; a resumed run ends with the parameters
(bias included) of an uninterrupted one; fine-tuning loads the bias frozen unless a rate is
given; eval runs the checkpoint as trained and refuses another balance."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import QUIET, TINY_MODEL, fails_clearly

pytestmark = pytest.mark.xdist_group("bias_balance")

BIAS = ["model.router.balance=bias", "model.router.bias_update_rate=0.01"]
PRETRAIN = ["pretrain", *TINY_MODEL, *QUIET, *BIAS, "train.steps=4", "schedule.warmup_steps=0",
            "checkpoint.every_steps=2", "train.log_every_steps=1", "eval.every_steps=0",
            "data.batch_size=16"]
FINETUNE = ["finetune", *TINY_MODEL, *QUIET, "model.router.balance=bias", "train.steps=2",
            "schedule.warmup_steps=0", "data.batch_size=16"]


def _params(workdir):
  from runner.checkpoints import checkpoint
  params, _, step = checkpoint.load_params(str(workdir))
  return params, step


def _bias(params) -> np.ndarray:
  return np.asarray(params["block_1"]["moe"]["router"]["balance_bias"])


def _leaves(tree):
  import jax
  return [(jax.tree_util.keystr(p), np.asarray(v))
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted 4 steps (read only: a test that writes takes a copy)."""
  from runner import cli
  workdir = tmp_path_factory.mktemp("bias_straight")
  assert cli.main([*PRETRAIN, f"workdir={workdir}"]) == 0
  return workdir


def test_pretraining_moves_the_bias_without_an_auxiliary_loss(straight):
  params, step = _params(straight)
  bias = _bias(params)
  assert step == 4 and bias.shape == (8,)
  # Four steps of +-0.01 (or 0 for an expert at the mean): multiples of 0.01 up to 0.04.
  assert np.abs(bias).max() > 0 and np.abs(bias).max() <= 0.04 + 1e-6
  np.testing.assert_allclose(bias * 100, np.round(bias * 100), atol=1e-4)
  train = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in train if "train/loss" in r]
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  assert all(r["train/aux_loss"] == 0 and r["train/loss"] == r["train/cls_loss"] for r in train)
  assert train[0]["moe/layer_1/bias_spread"] == 0  # the bias of step 1 is the initial zeros
  assert train[-1]["moe/layer_1/bias_spread"] > 0
  assert train[-1]["moe/layer_1/importance_loss"] > 0  # still reported
  assert np.isfinite(train[-1]["moe/layer_1/max_violation"])


def test_a_resumed_run_ends_with_the_uninterrupted_parameters(straight, tmp_path, run_cli):
  """The checkpoint of step 4 removed, the same command resumes from step 2: the same bias,
  the same choices, the same parameters."""
  shutil.copytree(straight, tmp_path, dirs_exist_ok=True)
  shutil.rmtree(tmp_path / "checkpoints" / "4")
  code, _, err = run_cli(*PRETRAIN, f"workdir={tmp_path}")
  assert code == 0, err
  resumed, step = _params(tmp_path)
  uninterrupted, _ = _params(straight)
  assert step == 4
  logged = [[json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text()
             .splitlines()] for workdir in (straight, tmp_path)]
  assert logged[1][len(logged[0])] == 3  # the run went on from step 2, not from scratch
  for (path, a), (_, b) in zip(_leaves(uninterrupted), _leaves(resumed)):
    np.testing.assert_array_equal(a, b, err_msg=path)


def test_fine_tuning_loads_the_bias_frozen_unless_a_rate_is_given(straight, tmp_path, run_cli):
  pretrained = _bias(_params(straight)[0])
  code, _, err = run_cli(*FINETUNE, f"workdir={tmp_path / 'frozen'}",
                         f"init.checkpoint={straight}")
  assert code == 0, err
  np.testing.assert_array_equal(_bias(_params(tmp_path / "frozen")[0]), pretrained)
  code, _, err = run_cli(*FINETUNE, f"workdir={tmp_path / 'moving'}",
                         f"init.checkpoint={straight}", "model.router.bias_update_rate=0.01")
  assert code == 0, err
  moved = _bias(_params(tmp_path / "moving")[0]) - pretrained
  assert np.abs(moved).max() > 0.005 and np.abs(moved).max() <= 0.02 + 1e-6
  # Without balance=bias the checkpoint's bias has no place: refused, naming the key.
  code, out, err = run_cli(*[a for a in FINETUNE if "balance" not in a],
                           f"workdir={tmp_path / 'plain'}", f"init.checkpoint={straight}")
  fails_clearly((code, out, err), "balance_bias: in the checkpoint but not in the model",
                "model.router.balance=bias")


def test_eval_runs_the_checkpoint_as_trained(straight, tmp_path, run_cli):
  code, _, err = run_cli("eval", f"init.checkpoint={straight}", f"workdir={tmp_path / 'ev'}",
                         *QUIET)
  assert code == 0, err
  summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
  assert any(k.endswith("prec@1") for k in summary)
  fails_clearly(run_cli("eval", f"init.checkpoint={straight}", f"workdir={tmp_path / 'no'}",
                        *QUIET, "model.router.balance=aux_loss"),
                "model.router.balance=aux_loss differs from the checkpoint's bias")
