"""`vmoe export` without PyTorch: what it writes (every parameter of the checkpoint once, under
PyTorch's names and layouts), and what it refuses before writing anything: no checkpoint, a run
still going or not finished, a folder that holds something else, a contrastive run, a router
family that does not say how it routes in PyTorch. The probabilities of what it writes are
checked in PyTorch by tests/export (`make test-export`)."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest

from conftest import QUIET, fails_clearly

pytestmark = pytest.mark.xdist_group("export")


@pytest.fixture(scope="module")
def finished(shared_run, tmp_path_factory) -> pathlib.Path:
  """A tiny V-MoE pretrained for 2 steps: a copy of the session's shared run, which a test locks."""
  workdir = tmp_path_factory.mktemp("export") / "up"
  shutil.copytree(shared_run("vmoe_2steps"), workdir)
  return workdir


def test_export_writes_every_parameter_once_in_pytorch_layouts(finished, run_cli, tmp_path):
  from safetensors.numpy import load_file

  from runner.checkpoints import weights
  from runner.models import transfer
  out = tmp_path / "exported"
  code, stdout, err = run_cli("export", f"init.checkpoint={finished}", f"workdir={out}", *QUIET)
  assert code == 0, err
  assert "vmoe export:" in stdout
  tensors = load_file(str(out / "model.safetensors"))
  params = transfer.flatten(weights.load(str(finished))[0])
  # Every value of the checkpoint, once: same count, same multiset of numbers.
  assert sum(t.size for t in tensors.values()) == sum(p.size for p in params.values())
  ours = np.sort(np.concatenate([np.ravel(p) for p in params.values()]).astype(np.float32))
  theirs = np.sort(np.concatenate([np.ravel(t) for t in tensors.values()]))
  np.testing.assert_array_equal(theirs, ours)
  # PyTorch's layouts: Linear (out, in), the patch embedding a Conv2d's (out, in, kh, kw).
  kernel = params["block_0/mlp/fc1/kernel"]
  linear = next(t for t in tensors.values() if t.shape == kernel.T.shape
                and np.array_equal(t, kernel.T))
  assert linear.shape == (64, 32)
  embedding = params["embedding_kernel"]  # (p, p, C, D)
  assert any(np.array_equal(t, embedding.transpose(3, 2, 0, 1)) for t in tensors.values())
  config = json.loads((out / "config.json").read_text())
  assert config["num_classes"] == 10 and config["image_size"] == 16
  assert config["preprocessing"]["scale"] == pytest.approx(1 / 127.5)
  assert config["preprocessing"]["offset"] == pytest.approx(-1.0)
  source = (out / "modeling_vmoe.py").read_text()
  assert "import jax" not in source and "import torch" in source
  assert "def load(" in source and "def predict_proba(" in source
  card = (out / "README.md").read_text()
  assert "val/prec@1" in card and "predict_proba" in card
  summary = json.loads((out / "summary.json").read_text())
  assert summary["export/tensors"] == len(tensors)
  assert not (out / "report.html").exists()  # a model folder, not a run's page
  # A rerun replaces its own export, also after a user's Python imported modeling_vmoe.py there.
  (out / "__pycache__").mkdir(exist_ok=True)
  (out / "__pycache__" / "modeling_vmoe.cpython-311.pyc").write_bytes(b"")
  assert run_cli("export", f"init.checkpoint={finished}", f"workdir={out}", *QUIET)[0] == 0


def test_export_refuses_what_it_cannot_take_before_writing(finished, run_cli, tmp_path):
  from runner.workdirs.workdir_lock import WorkdirLock
  out = tmp_path / "out"
  fails_clearly(run_cli("export", f"workdir={out}", *QUIET), "init.checkpoint=")
  fails_clearly(run_cli("export", f"init.checkpoint={tmp_path / 'nowhere'}", f"workdir={out}",
                        *QUIET), "does not exist")
  unfinished = tmp_path / "unfinished"
  shutil.copytree(finished, unfinished)
  (unfinished / "summary.json").unlink()
  fails_clearly(run_cli("export", f"init.checkpoint={unfinished}", f"workdir={out}", *QUIET),
                "did not finish", "checkpoints/<step>")
  with WorkdirLock(str(finished), "vmoe pretrain (a test)"):
    fails_clearly(run_cli("export", f"init.checkpoint={finished}", f"workdir={out}", *QUIET),
                  "still being written")
  assert not out.exists()
  kept = tmp_path / "kept"
  kept.mkdir()
  (kept / "notes.txt").write_text("mine")
  fails_clearly(run_cli("export", f"init.checkpoint={finished}", f"workdir={kept}", *QUIET),
                "notes.txt", "not an export")
  assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
  # A step folder named explicitly is taken as it is, finished or not.
  step = next((unfinished / "checkpoints").iterdir())
  code, _, err = run_cli("export", f"init.checkpoint={step}", f"workdir={out}", *QUIET)
  assert code == 0, err


def test_a_router_family_that_says_nothing_of_pytorch_is_refused(monkeypatch):
  from runner.config import relations
  from runner.config.schema import ExportRun
  from runner.models import model_config
  from runner.models.moe import routers
  model = model_config("vmoe_tiny")
  run = ExportRun(model=model)
  assert relations.exporter_expresses_the_router(model, run) is None
  monkeypatch.setattr(routers.family("token_choice"), "torch_routing",
                      classmethod(lambda cls, router, *, tokens, experts: None))
  problem = relations.exporter_expresses_the_router(model, run)
  assert "model.router.type=token_choice" in problem and "torch_routing" in problem
  dense = dataclasses.replace(model, moe=dataclasses.replace(model.moe, layers=[]))
  assert relations.exporter_expresses_the_router(dense, run) is None
