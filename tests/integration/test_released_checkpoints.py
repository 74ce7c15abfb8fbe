"""Released checkpoints through the CLI: google-research/vmoe's format (a V-MoE and an E³ model) and
a big_vision ViT `.npz`, written by the tests' own writers with reference-named random parameters
shaped like the tiny test model, then evaluated, fine-tuned (upcycled, at a new resolution),
few-shot evaluated, ensembled and compressed; a checkpoint without its config needs model= and
data=.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from conftest import QUIET, TINY_MODEL
from formats import vmoe_writer
from formats.reference_tree import Dims, reference_tree

from runner.checkpoints import checkpoint
from runner.models.transfer import flatten

pytestmark = pytest.mark.xdist_group("released")

DIMS = Dims(hidden=32, layers=2, mlp=64, heads=2, patch=4, image=16, classes=10)
EXPERTS = 8  # vmoe_tiny's, on block 1 of 2 (every2)
EVAL = [*QUIET, "data=uci_digits", "eval.corruptions=[]", "eval.ood_datasets=[]",
        "eval.capacity_sweep=[]"]
FINETUNE = [*QUIET, "train.steps=2", "schedule.warmup_steps=0", "data.batch_size=16"]
# Fine-tuning that leaves the transferred parameters readable in the checkpoint: the recipe's SGD
# (momentum 0.9, gradients clipped to global norm 1, no weight decay) moves the whole parameter
# vector by at most lr * (1 + 1.9) in L2 norm over 2 steps (momentum 1 + 0.9 at the second), so
# every parameter the checkpoint holds is what the transfer made to within TRANSFER_ATOL.
BARELY_LEARNING = ["optim.lr=1e-6"]
TRANSFER_ATOL = 3e-6  # 2.9e-6, plus float32 rounding of values below 2 (at most 1.2e-7)


def _summary(workdir: pathlib.Path) -> dict:
  return json.loads((workdir / "summary.json").read_text())


def _finetuned(workdir: pathlib.Path) -> dict[str, np.ndarray]:
  """The last checkpoint's parameters by name, once sure the run barely moved them."""
  params, config, step = checkpoint.load_params(str(workdir))
  optim = config["optim"]
  assert step == 2 and optim["name"] == "sgd" and optim["lr"] == 1e-6
  assert (optim["momentum"], optim["grad_clip_norm"], optim["weight_decay"]) == (0.9, 1.0, 0.0)
  return flatten(params)


def _corner_aligned_resize(posemb: np.ndarray, side: int) -> np.ndarray:
  """(1, n*n, D) -> (1, side*side, D): new cell j on each axis is the linear interpolation of the
  old grid at position j * (n - 1) / (side - 1) (big_vision's resample_posemb), two 1-D passes."""
  n = int(round(posemb.shape[1] ** 0.5))
  grid = posemb.astype(np.float64).reshape(n, n, -1)
  where = np.arange(side) * (n - 1) / (side - 1)
  low = np.minimum(np.floor(where).astype(int), n - 2)
  frac = (where - low)[:, None, None]
  grid = grid[low] * (1 - frac) + grid[low + 1] * frac  # rows
  frac = frac.transpose(1, 0, 2)
  grid = grid[:, low] * (1 - frac) + grid[:, low + 1] * frac  # columns
  return grid.reshape(1, side * side, -1)


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> dict[str, str]:
  root = tmp_path_factory.mktemp("released")
  vmoe = reference_tree("vmoe", moe_layers=(1,), experts=EXPERTS, dims=DIMS)
  vmoe_writer.write(str(root / "vmoe_tiny"), vmoe, num_shards=3, chunks_per_array=2)
  e3 = reference_tree("vmoe", seed=1, moe_layers=(1,), experts=EXPERTS, members=2, dims=DIMS)
  vmoe_writer.write(str(root / "e3_tiny"), e3, num_shards=2)
  vit = reference_tree("big_vision", seed=2, dims=DIMS)
  np.savez(root / "vit_tiny.npz", **{f"params/{k}": v for k, v in vit.items()})
  return {"vmoe": str(root / "vmoe_tiny"), "e3": str(root / "e3_tiny.index"),
          "vit": str(root / "vit_tiny.npz"), "root": str(root),
          "vmoe_params": str(sum(v.size for v in vmoe.values()) - DIMS.hidden)}  # class position folded


def test_vmoe_checkpoint_evaluates(run_cli, released, tmp_path):
  code, _, err = run_cli("eval", f"init.checkpoint={released['vmoe']}", "model=vmoe_tiny",
                         *TINY_MODEL, *EVAL, f"workdir={tmp_path}")
  assert code == 0, err
  summary = _summary(tmp_path)
  assert 0.0 <= summary["uci_digits/prec@1"] <= 1.0 and np.isfinite(summary["uci_digits/nll"])
  assert summary["compute/params_total"] == int(released["vmoe_params"])


def test_released_checkpoint_without_model_and_data_is_a_clear_error(run_cli, released, tmp_path):
  code, _, err = run_cli("eval", f"init.checkpoint={released['vmoe']}", *QUIET,
                         f"workdir={tmp_path / 'x'}")
  assert code == 2 and "Traceback" not in err
  assert "google-research/vmoe checkpoint" in err and "model=" in err and "data=" in err
  assert "hidden size 32" in err  # what the checkpoint looks like
  assert not (tmp_path / "x").exists()


def test_released_checkpoint_with_a_missing_shard_is_a_clear_error(run_cli, released, tmp_path):
  broken = pathlib.Path(released["root"]) / "broken"
  tree = reference_tree("vmoe", moe_layers=(1,), experts=EXPERTS, dims=DIMS)
  vmoe_writer.write(str(broken), tree, num_shards=2)
  pathlib.Path(f"{broken}.data-00001-of-00002").unlink()
  code, _, err = run_cli("eval", f"init.checkpoint={broken}", "model=vmoe_tiny", *TINY_MODEL,
                         *EVAL, f"workdir={tmp_path / 'x'}")
  assert code == 2 and "Traceback" not in err and "data-00001-of-00002" in err
  assert not any((tmp_path / "x" / a).exists() for a in ("summary.json", "metrics.jsonl", "wandb"))


def test_vmoe_checkpoint_finetunes_at_a_new_resolution(run_cli, released, tmp_path):
  code, _, err = run_cli("finetune", f"init.checkpoint={released['vmoe']}", "model=vmoe_tiny",
                         *TINY_MODEL, "model.image_size=24", *FINETUNE, *BARELY_LEARNING,
                         f"workdir={tmp_path}")
  assert code == 0, err  # 4x4 -> 6x6 position embeddings, a new head
  assert (tmp_path / "checkpoints").is_dir()
  posemb = _finetuned(tmp_path)["pos_embedding"]
  assert posemb.shape == (1, 36, DIMS.hidden)
  # The released posemb's first row is the class token's (folded into cls): the patches' 4x4 grid.
  released_grid = reference_tree("vmoe", moe_layers=(1,), experts=EXPERTS, dims=DIMS)[
      "Encoder/posembed_input/pos_embedding"][:, 1:]
  np.testing.assert_allclose(posemb, _corner_aligned_resize(released_grid, 6), rtol=0,
                             atol=TRANSFER_ATOL)


def test_e3_checkpoint_evaluates_as_an_ensemble_and_finetunes(run_cli, released, tmp_path):
  code, _, err = run_cli("eval", f"init.checkpoint={released['e3']}", "model=vmoe_tiny_k1_m2",
                         *TINY_MODEL, *EVAL, f"workdir={tmp_path / 'eval'}")
  assert code == 0, err
  summary = _summary(tmp_path / "eval")
  assert summary["ensemble/size"] == 2 and summary["ensemble/type"] == "pbe"
  assert summary["uci_digits/diversity/kl"] > 0  # two members with their own experts and routers
  code, _, err = run_cli("finetune", f"init.checkpoint={released['e3']}", "model=vmoe_tiny_k1_m2",
                         *TINY_MODEL, *FINETUNE, f"workdir={tmp_path / 'ft'}")
  assert code == 0, err
  code, _, err = run_cli("finetune", f"init.checkpoint={released['e3']}", "model=vmoe_tiny_k1_m4",
                         *TINY_MODEL, *FINETUNE, f"workdir={tmp_path / 'm4'}")
  assert code == 2 and "Traceback" not in err and "ensemble" in err
  assert not (tmp_path / "m4" / "checkpoints").exists()


def test_e3_checkpoint_compresses_each_members_partition(run_cli, released, tmp_path):
  """A released partitioned ensemble (2 members of 4 experts) merged to 2 of 2 each: no group
  crosses a member's partition, and the compressed folder evaluates as the same ensemble."""
  code, _, err = run_cli("compress", f"init.checkpoint={released['e3']}", "model=vmoe_tiny_k1_m2",
                         *TINY_MODEL, *QUIET, "data=uci_digits", "compress.experts=4",
                         "compress.examples=64", "data.eval_batch_size=32",
                         f"workdir={tmp_path / 'merged'}")
  assert code == 0, err
  code, _, err = run_cli("compress", f"init.checkpoint={released['e3']}", "model=vmoe_tiny_k1_m2",
                         *TINY_MODEL, *QUIET, "data=uci_digits", "compress.experts=3",
                         f"workdir={tmp_path / 'odd'}")
  assert code == 2 and "members keeps as many" in err and not (tmp_path / "odd").exists()
  new_expert = _summary(tmp_path / "merged")["compress/layer_1/new_expert"]
  assert set(new_expert[:4]) == {0, 1} and set(new_expert[4:]) == {2, 3}
  code, _, err = run_cli("eval", f"init.checkpoint={tmp_path / 'merged'}", *EVAL,
                         f"workdir={tmp_path / 'eval'}")
  assert code == 0, err
  summary = _summary(tmp_path / "eval")
  assert summary["ensemble/size"] == 2 and summary["compute/params_total"] < int(
      released["vmoe_params"])


def test_vit_npz_evaluates_and_upcycles_into_a_vmoe(run_cli, released, tmp_path):
  code, _, err = run_cli("eval", f"init.checkpoint={released['vit']}", "model=vit_tiny",
                         *TINY_MODEL, *EVAL, f"workdir={tmp_path / 'eval'}")
  assert code == 0, err
  code, _, err = run_cli("finetune", f"init.checkpoint={released['vit']}", "model=vmoe_tiny",
                         *TINY_MODEL, "init.dense_to_experts=true", *FINETUNE, *BARELY_LEARNING,
                         f"workdir={tmp_path / 'up'}")
  assert code == 0, err
  upcycled = _finetuned(tmp_path / "up")
  dense = reference_tree("big_vision", seed=2, dims=DIMS)
  mlp = "Transformer/encoderblock_1/MlpBlock_0"  # block 1 of 2 becomes the MoE layer (every2)
  for expert, reference in (("fc1_kernel", "Dense_0/kernel"), ("fc1_bias", "Dense_0/bias"),
                            ("fc2_kernel", "Dense_1/kernel"), ("fc2_bias", "Dense_1/bias")):
    experts = upcycled[f"block_1/moe/experts/{expert}"]
    assert experts.shape == (EXPERTS, *dense[f"{mlp}/{reference}"].shape)
    for weights in experts:  # every expert starts as the dense MLP it replaces
      np.testing.assert_allclose(weights, dense[f"{mlp}/{reference}"], rtol=0, atol=TRANSFER_ATOL)
  assert "block_1/mlp/fc1/kernel" not in upcycled
  code, _, err = run_cli("finetune", f"init.checkpoint={released['vit']}", "model=vmoe_tiny",
                         *TINY_MODEL, *FINETUNE, f"workdir={tmp_path / 'no'}")
  assert code == 2 and "init.dense_to_experts=true" in err


@pytest.mark.slow
def test_released_checkpoints_few_shot_and_ensemble(run_cli, released, tmp_path):
  code, _, err = run_cli("fewshot", f"init.checkpoint=[{released['vit']}]", "model=vit_tiny",
                         *TINY_MODEL, *QUIET, "fewshot.datasets=[uci_digits]", "fewshot.shots=[1,5]",
                         "fewshot.seeds=[0]", f"workdir={tmp_path / 'fewshot'}")
  assert code == 0, err
  assert 0.0 <= _summary(tmp_path / "fewshot")["uci_digits/5shot/accuracy"] <= 1.0
  other = pathlib.Path(released["root"]) / "vmoe_tiny_b"
  vmoe_writer.write(str(other), reference_tree("vmoe", seed=7, moe_layers=(1,), experts=EXPERTS,
                                               dims=DIMS))
  code, _, err = run_cli("ensemble", f"init.checkpoint=[{released['vmoe']},{other}]",
                         "model=vmoe_tiny", *TINY_MODEL, *EVAL, f"workdir={tmp_path / 'ens'}")
  assert code == 0, err
  summary = _summary(tmp_path / "ens")
  assert summary["ensemble/size"] == 2 and summary["ensemble/type"] == "up-DE"
