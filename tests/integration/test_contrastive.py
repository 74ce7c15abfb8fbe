"""`vmoe pretrain objective=contrastive` end to end through the CLI, on tiny runs: training two
towers from scratch (summary, checkpoints, main metric), LiT from an image model's run with a
HET-XL head (the image tower bit for bit the upstream one, the text tower learning, the learned
scale starting at 3.0 for HET-XL and 10.0 for the deterministic baseline), resuming after a kill
(exactly the uninterrupted run), bfloat16, the sigmoid loss, and a tokenizer trained on the
training captions that a resumed run reuses. On 8 devices: tests/multidevice/
test_contrastive_meshes.py; bad input: tests/integration/test_bad_input.py.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import QUIET, TINY_MODEL, TINY_TEXT, fails_clearly

pytestmark = pytest.mark.xdist_group("contrastive")

# Validation and test on 64 examples each, one batch: the same keys as on whole splits.
SMALL_EVAL = ['data.eval_split="validation[:64]"', 'data.test_split="test[:64]"',
              "data.eval_batch_size=64"]
CONTRASTIVE = ["objective=contrastive", *TINY_MODEL, *QUIET, *TINY_TEXT, *SMALL_EVAL,
               "data.batch_size=16", "train.log_every_steps=1"]
# LiT with a HET-XL head, from the upstream run: checkpoints at 2, 4, 6, 8, all kept.
LIT = [*CONTRASTIVE, "model.head.type=het_xl", "train.steps=8", "schedule.warmup_steps=0",
       "checkpoint.every_steps=2",
       "checkpoint.keep=4"]
TIMINGS = ("images_per_s",)  # measured, not computed: they differ between two runs


def _main(*args: str) -> None:
  from runner import cli
  assert cli.main(list(args)) == 0, args


def _summary(workdir: pathlib.Path) -> dict:
  return json.loads((workdir / "summary.json").read_text())


def _records(workdir: pathlib.Path) -> dict[int, dict]:
  """metrics.jsonl as step -> every metric logged at that step (the last value written wins, as
  a resumed run writes the steps it redoes again)."""
  out: dict[int, dict] = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    out.setdefault(record.pop("step"), {}).update(record)
  return out


def _params(workdir: pathlib.Path, step: int | None = None) -> tuple[dict, int]:
  """({'a/b/c': array}, step) of the newest checkpoint, or of `step`."""
  from runner.checkpoints import checkpoint
  from runner.models.transfer import flatten
  path = workdir if step is None else workdir / "checkpoints" / str(step)
  params, _, at = checkpoint.load_params(str(path))
  return {k: np.asarray(v) for k, v in flatten(params).items()}, at


def _under(flat: dict, prefix: str) -> dict:
  return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


def _finite(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> pathlib.Path:
  return tmp_path_factory.mktemp("contrastive")


@pytest.fixture(scope="module")
def upstream(shared_run) -> pathlib.Path:
  """An image model's run: the tiny V-MoE classifier, 2 steps on MNIST (the session's shared
  run: read, never written)."""
  return shared_run("vmoe_2steps")


@pytest.fixture(scope="module")
def det(root) -> pathlib.Path:
  """Two towers from scratch on the embedded captioned digits (the default data), 4 steps."""
  _main("pretrain", f"workdir={root / 'det'}", *CONTRASTIVE, "train.steps=4",
        "schedule.warmup_steps=0")
  return root / "det"


@pytest.fixture(scope="module")
def lit(root, upstream) -> pathlib.Path:
  """LiT from the upstream run with HET-XL noise, 8 steps."""
  _main("pretrain", f"workdir={root / 'lit'}", f"init.checkpoint={upstream}", *LIT)
  return root / "lit"


# --- from scratch ---------------------------------------------------------------------------------

def test_pretrain_from_scratch_writes_summary_checkpoints_and_main_metric(det):
  from runner.config.subcommands import main_metric
  summary = _summary(det)
  assert summary["step"] == 4
  for split in ("val", "test"):
    for key in ("i2t_prec@1", "t2i_prec@1", "zero_shot_prec@1"):
      assert 0.0 <= summary[f"{split}/{key}"] <= 1.0, (split, key)
    for key in ("loss", "i2t_loss", "t2i_loss"):
      assert _finite(summary[f"{split}/{key}"]) and summary[f"{split}/{key}"] > 0, (split, key)
  assert _finite(summary["train/loss"]) and _finite(summary["train/contrastive_loss"])
  # The stage's main metric (what a search maximises): zero-shot accuracy on validation.
  assert main_metric("pretrain", summary) == summary["val/zero_shot_prec@1"]

  config = (det / "config.yaml").read_text()
  assert "name: contrastive" in config and "mnist5k_captions" in config
  assert sorted(p.name for p in (det / "checkpoints").iterdir()) == ["4"]
  flat, step = _params(det)
  assert step == 4
  towers = {k.split("/")[0] for k in flat}
  # Both towers and their projections through the one Orbax checkpoint; no classifier head and,
  # for the deterministic baseline, no HET-XL noise layers.
  assert towers == {"image", "text", "image_projection", "text_projection", "log_temperature"}
  assert not any(k.startswith("image/head") for k in flat)
  assert flat["image_projection/kernel"].shape == (32, 16)
  assert flat["text_projection/kernel"].shape == (32, 16)
  assert flat["text/token_embedding/embedding"].shape == (256 + 3, 32)  # bytes: 3 special ids
  assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in flat.values())

  records = _records(det)
  assert sorted(records) == [1, 2, 3, 4]
  # The learned scale starts at 10 for the deterministic baseline (the HET-XL paper's App. N).
  assert records[1]["train/temperature"] == pytest.approx(10.0, abs=1e-5)
  assert all(_finite(records[s]["train/loss"]) for s in records if "train/loss" in records[s])


def test_summarize_tabulates_a_contrastive_run(det, tmp_path, run_cli):
  """`vmoe summarize` over a folder of contrastive runs: their main metric in the table."""
  import shutil
  shutil.copytree(det, tmp_path / "runs" / "0")
  code, out, err = run_cli("summarize", str(tmp_path / "runs"), "--no-plots")
  assert code == 0, err
  assert "Traceback" not in err
  table = (tmp_path / "runs" / "summary.md").read_text()
  assert f"{_summary(det)['val/zero_shot_prec@1']:.4f}" in table, table


def test_export_refuses_a_contrastive_run(det, tmp_path, run_cli):
  """vmoe export writes classifiers: it names the way to one, and writes nothing."""
  fails_clearly(run_cli("export", f"init.checkpoint={det}", f"workdir={tmp_path / 'out'}", *QUIET),
                "contrastive run", "init.tower=image")
  assert not (tmp_path / "out").exists()


# --- LiT ------------------------------------------------------------------------------------------

def test_lit_locks_the_image_tower_and_trains_the_rest(lit, upstream):
  up, _ = _params(upstream)
  final, step = _params(lit)
  early, _ = _params(lit, 2)
  assert step == 8
  # The image tower is the upstream model without its head, bit for bit, all along.
  expected = {k: v for k, v in up.items() if not k.startswith("head/")}
  for flat in (early, final):
    image = _under(flat, "image/")
    assert sorted(image) == sorted(expected)
    for key, value in expected.items():
      np.testing.assert_array_equal(image[key], value, err_msg=key)
  # The text tower, both projections, the scale and HET-XL's noise layers learn.
  for prefix in ("text/", "text_projection/", "image_projection/", "log_temperature",
                 "image_noise/", "text_noise/"):
    keys = [k for k in final if k.startswith(prefix)]
    assert keys, prefix
    assert any(not np.array_equal(final[k], early[k]) for k in keys), f"{prefix} did not change"
  # HET-XL's noise of the paper's Sec. 5: R = 15 factors over the 16-dim embedding, not
  # parameter-efficient (a full D x DR factor matrix).
  for tower in ("image", "text"):
    assert final[f"{tower}_noise/scale_layer/kernel"].shape == (16, 16 * 15)
    assert final[f"{tower}_noise/diag_layer/kernel"].shape == (16, 16)

  records = _records(lit)
  # The learned scale starts at 3 for HET-XL (App. N).
  assert records[1]["train/temperature"] == pytest.approx(3.0, abs=1e-5)
  assert all(_finite(r["train/loss"]) for r in records.values() if "train/loss" in r)
  summary = _summary(lit)
  assert 0.0 <= summary["val/zero_shot_prec@1"] <= 1.0 and _finite(summary["val/loss"])
  config = (lit / "config.yaml").read_text()
  assert "lock_image: true" in config and str(upstream) in config


# --- resume after a kill --------------------------------------------------------------------------

# Runs `vmoe <argv>` and SIGKILLs itself right after it starts saving step KILL_AT's checkpoint
# (asynchronously: that save is cut off mid-write; step KILL_AT - 2 is committed).
KILL_AT = 6
_KILLED_RUN = f"""
import os, signal, sys
from runner.command import allocator
allocator.pause_collector()  # as `vmoe` starts
from runner import cli
from runner.checkpoints import checkpoint
save = checkpoint.Checkpointer.save
def save_then_die(self, step, *args, **kwargs):
  save(self, step, *args, **kwargs)
  if step == {KILL_AT}:
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint.Checkpointer.save = save_then_die
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_killed_lit_run_resumes_to_the_uninterrupted_one(lit, upstream, tmp_path, run_cli):
  """LiT with HET-XL noise (the image tower locked, noise draws each step) killed at step 6 and
  rerun: the same parameters, training losses and final metrics as the run never killed."""
  args = ["pretrain", f"workdir={tmp_path}", f"init.checkpoint={upstream}", *LIT]
  proc = subprocess.run([sys.executable, "-c", _KILLED_RUN, *args], capture_output=True,
                        text=True, env=dict(os.environ), timeout=300)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  committed = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                     if p.name.isdigit())
  assert committed and committed[-1] <= KILL_AT and not (tmp_path / "summary.json").exists()

  code, _, err = run_cli(*args)
  assert code == 0, err
  resumed, step = _params(tmp_path)
  expected, _ = _params(lit)
  assert step == 8 and sorted(resumed) == sorted(expected)
  for key, value in expected.items():
    np.testing.assert_allclose(resumed[key], value, rtol=0, atol=1e-6, err_msg=key)
  # Every training step's metrics (the redone ones rewritten) and the final evaluation.
  want, got = _records(lit), _records(tmp_path)
  assert sorted(got) == sorted(want)
  for s in want:
    for key, value in want[s].items():
      if isinstance(value, float) and not key.endswith(TIMINGS):
        assert got[s][key] == pytest.approx(value, rel=1e-6, abs=1e-6), (s, key)
  a, b = _summary(lit), _summary(tmp_path)
  for key, value in a.items():
    if isinstance(value, float) and key.startswith(("val/", "test/")) \
        and not key.endswith(TIMINGS):
      assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


# --- precision, losses, tokenizers ----------------------------------------------------------------

def test_bfloat16_trains_with_finite_losses(det, root):
  workdir = root / "bf16"
  _main("pretrain", f"workdir={workdir}", *CONTRASTIVE, "model.dtype=bfloat16", "train.steps=2",
        "schedule.warmup_steps=0")
  records, summary = _records(workdir), _summary(workdir)
  losses = [records[s]["train/loss"] for s in (1, 2)]
  assert all(_finite(x) for x in losses)
  assert _finite(summary["val/loss"]) and _finite(summary["test/loss"])
  assert 0.0 <= summary["val/zero_shot_prec@1"] <= 1.0
  # The same first batch and initial parameters as the float32 run: close, but computed in
  # bfloat16 (not the same float32 numbers).
  reference = _records(det)[1]["train/loss"]
  assert losses[0] == pytest.approx(reference, rel=0.05) and losses[0] != reference
  flat, _ = _params(workdir)
  assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in flat.values())


def test_sigmoid_loss_with_a_trained_tokenizer_that_a_resumed_run_reuses(root, run_cli,
                                                                         monkeypatch):
  workdir = root / "sigmoid"
  args = ["pretrain", f"workdir={workdir}", *CONTRASTIVE, "objective.loss=sigmoid",
          "text.tokenizer.kind=train", "text.tokenizer.vocab_size=64"]
  code, _, err = run_cli(*args, "train.steps=2", "schedule.warmup_steps=0")
  assert code == 0, err
  model_file = workdir / "tokenizer.model"
  assert model_file.is_file()
  before = model_file.read_bytes()
  from runner.data import tokenizers
  tok = tokenizers.load_sentencepiece(str(model_file))
  flat, _ = _params(workdir)
  assert flat["text/token_embedding/embedding"].shape[0] == tok.vocab_size <= 64
  # The sigmoid loss learns a bias (SigLIP's, started at -10).
  assert flat["bias"].shape == () and abs(float(flat["bias"]) + 10) < 0.1
  records = _records(workdir)
  assert all(_finite(records[s]["train/loss"]) for s in (1, 2))
  summary = _summary(workdir)
  assert _finite(summary["val/loss"]) and 0.0 <= summary["val/i2t_prec@1"] <= 1.0

  # Resumed (2 more steps): the tokenizer in the workdir is read, never trained again.
  def no_training(*_args, **_kwargs):
    raise AssertionError("a resumed run trained a new tokenizer")
  monkeypatch.setattr(tokenizers, "train_sentencepiece", no_training)
  code, _, err = run_cli(*args, "train.steps=4", "schedule.warmup_steps=0")
  assert code == 0, err
  assert model_file.read_bytes() == before
  assert sorted(_records(workdir)) == [1, 2, 3, 4] and _params(workdir)[1] == 4
