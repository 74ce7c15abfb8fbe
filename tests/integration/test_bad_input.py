"""Bad input fails before any compute: exit code 2, one paragraph naming what is valid, no traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import QUIET, TINY_MODEL

FAST = [*QUIET, "train.steps=1", "data.batch_size=16"]


def _fails_clearly(result, *expected):
  code, out, err = result
  assert code == 2, (code, out, err)
  assert "Traceback" not in err and "Traceback" not in out
  message = err.strip().splitlines()
  assert len(message) == 1, err  # one paragraph
  for text in expected:
    assert text in err, (text, err)
  return err


@pytest.mark.parametrize("args, expected", [
    (["model=vmoe_nope"], ["unknown model 'vmoe_nope'", "vmoe_tiny", "vit_b16"]),
    (["data=nope"], ["data=", "mnist5k", "uci_digits", "image_folder"]),
    (["optim=nope"], ["optim=", "adam", "sgd", "adafactor"]),
    (["optim.name=adamw"], ["optim.name", "adam", "sgd", "adafactor"]),
    (["optim.lrr=1"], ["unknown config key 'optim.lrr'", "lr", "momentum"]),
    (["train.steps=many"], ["train.steps"]),
    (["model.router.k=9"], ["model.router.k=9", "num_experts=8", "1 <= k <= 8"]),
    (["model.router.capacity_ratio=0"], ["capacity_ratio"]),
    (["data.batch_size=12"], ["group_size=8"]),
    (["data=tfds", "data.name=cifar10"], ["cifar10", "not prepared", "tfds build"]),
    (["data=tfds", "data.name=no_such_dataset"], ["unknown dataset 'no_such_dataset'", "mnist5k"]),
    (["data=image_folder"], ["data.root"]),
    (["data.split=val"], ["no split 'val'", "train (4000 examples)"]),
    (['data.pp_train="decode|blur(3)"'], ["unknown preprocessing op 'blur'", "resize"]),
    (["data.pp_train=decode|blur(3)"], ["must be quoted"]),
    (["init.checkpoint=/no/such/run"], ["does not exist"]),
])
def test_pretrain_bad_input(args, expected, run_cli, tmp_path):
  _fails_clearly(run_cli("pretrain", f"workdir={tmp_path}", *TINY_MODEL, *FAST, *args), *expected)
  assert not (tmp_path / "checkpoints").exists()


def test_unknown_subcommand(run_cli):
  _fails_clearly(run_cli("pretrian"), "unknown subcommand 'pretrian'", "pretrain", "finetune")


def test_finetune_from_a_missing_checkpoint(run_cli, tmp_path):
  _fails_clearly(run_cli("finetune", f"workdir={tmp_path}", "init.checkpoint=/no/such/run", *FAST),
                 "does not exist")


def test_finetune_from_an_empty_folder(run_cli, tmp_path):
  (tmp_path / "empty").mkdir()
  _fails_clearly(run_cli("finetune", f"workdir={tmp_path / 'w'}",
                         f"init.checkpoint={tmp_path / 'empty'}", *FAST), "no checkpoint found")


def test_checkpoint_of_the_wrong_shape(run_cli, tmp_path):
  code, _, err = run_cli("pretrain", f"workdir={tmp_path / 'up'}", "model=vit_tiny", *TINY_MODEL,
                         *FAST)
  assert code == 0, err
  bigger = [o for o in TINY_MODEL if "hidden_size" not in o] + ["model.hidden_size=48"]
  err = _fails_clearly(run_cli("finetune", f"workdir={tmp_path / 'down'}", "model=vit_tiny",
                               f"init.checkpoint={tmp_path / 'up'}", *bigger, *FAST),
                       "does not fit the model", "checkpoint (32,) vs model (48,)",
                       "model.hidden_size 32 -> 48")
  assert not (tmp_path / "down" / "checkpoints").exists()


def test_eval_needs_a_checkpoint(run_cli, tmp_path):
  _fails_clearly(run_cli("eval", f"workdir={tmp_path}", *QUIET), "init.checkpoint")


def test_debug_shows_the_traceback(run_cli, tmp_path):
  code, _, err = run_cli("pretrain", f"workdir={tmp_path}", *TINY_MODEL, *FAST, "model.router.k=9",
                         "debug=true")
  assert code != 0 and 'File "' in err and "ConfigError: model.router.k=9" in err


def test_console_script_exit_code_and_message():
  """The installed `vmoe` executable itself: non-zero exit, the paragraph, no traceback."""
  exe = os.path.join(os.path.dirname(sys.executable), "vmoe")
  proc = subprocess.run([exe, "pretrain", "model=vmoe_nope"], capture_output=True, text=True,
                        env=dict(os.environ), timeout=300)
  assert proc.returncode == 2
  assert "unknown model 'vmoe_nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_subcommands_and_config(run_cli):
  code, out, _ = run_cli("--help")
  assert code == 0
  for sub in ("pretrain", "finetune", "fewshot", "eval"):
    assert f"  {sub} " in out
  code, out, _ = run_cli("pretrain", "--help")
  assert code == 0 and "model: " in out and "vmoe_tiny" in out and "optim: " in out
  code, out, _ = run_cli("pretrain", "--cfg", "job", "model=vit_s32")
  assert code == 0
  assert "hidden_size: 512" in out and "patch_size: 32" in out and "num_layers: 8" in out
