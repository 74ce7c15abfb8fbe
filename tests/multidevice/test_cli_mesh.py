"""The CLI on 8 (fake) devices: expert-parallel runs end to end, and mesh mistakes fail clearly."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import QUIET, TINY_MODEL

from runner.checkpoints import weights
from runner.models import transfer

pytestmark = pytest.mark.skipif(jax.device_count() != 8,
                                reason="needs 8 devices (run via test_multidevice.py)")
FAST = [*TINY_MODEL, *QUIET, "train.steps=2", "schedule.warmup_steps=0", "data.batch_size=64"]


def test_expert_parallel_pretrain_then_finetune_on_one_expert_axis(run_cli, tmp_path):
  code, _, err = run_cli("pretrain", f"workdir={tmp_path / 'up'}", *FAST, "sharding=ep")
  assert code == 0, err
  config = json.loads(json.dumps(__import__("yaml").safe_load(
      (tmp_path / "up" / "config.yaml").read_text())))
  assert config["mesh"]["expert"] == -1 and config["sharding"]["name"] == "ep"
  # Fine-tune the expert-parallel checkpoint with a different mesh (data parallel only).
  code, _, err = run_cli("finetune", f"workdir={tmp_path / 'down'}",
                         f"init.checkpoint={tmp_path / 'up'}", *FAST, "mesh.data=8")
  assert code == 0, err
  code, _, err = run_cli("eval", f"init.checkpoint={tmp_path / 'down'}",
                         f"workdir={tmp_path / 'ev'}", *QUIET, "sharding=fsdp_ep", "mesh.expert=4")
  assert code == 0, err


@pytest.mark.parametrize("args, expected", [
    (["mesh.data=3"], ["mesh.data=3", "8 devices"]),
    (["mesh.data=-1", "mesh.expert=3"], ["mesh.expert=3", "does not divide the 8 devices"]),
    (["mesh.data=2", "mesh.expert=4", "model.moe.num_experts=6"],
     ["num_experts=6", "mesh.expert=4"]),
    (["data.batch_size=32"], ["data.batch_size=32", "group_size=8"]),
    (["data.batch_size=60"], ["divisible by the 8 devices"]),
])
def test_mesh_mistakes_fail_before_compilation(args, expected, run_cli, tmp_path):
  code, _, err = run_cli("pretrain", f"workdir={tmp_path}", *FAST, *args)
  assert code == 2, err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1
  for text in expected:
    assert text in err, (text, err)
  assert not (tmp_path / "checkpoints").exists()


def test_drop_upcycling_starts_alike_on_every_mesh(run_cli, tmp_path):
  """Drop-Upcycling draws on the host, seeded by the seed and the block, before the parameters
  reach the devices: a V-MoE upcycled from a ViT starts the same experts data-parallel and with
  the experts split over the devices (sharding=ep). A learning rate of 1e-9 leaves the saved
  step's parameters the starting ones to within 1e-6."""
  assert run_cli("pretrain", "model=vit_tiny", f"workdir={tmp_path / 'vit'}", *FAST)[0] == 0
  experts = {}
  for sharding in ("dp", "ep"):
    code, _, err = run_cli("finetune", "model=vmoe_tiny", f"init.checkpoint={tmp_path / 'vit'}",
                           "init.dense_to_experts=true", "init.drop_upcycling_ratio=0.5",
                           "optim.lr=1e-9", f"sharding={sharding}",
                           f"workdir={tmp_path / sharding}", *FAST)
    assert code == 0, err
    flat = transfer.flatten(weights.load(str(tmp_path / sharding))[0])
    experts[sharding] = {k: v for k, v in flat.items() if "/moe/experts/" in k}
  for name, value in experts["dp"].items():
    np.testing.assert_allclose(experts["ep"][name], value, atol=1e-6, err_msg=name)
  kernel = experts["dp"]["block_1/moe/experts/fc1_kernel"]
  assert not np.allclose(kernel[0], kernel[1])  # the copies were redrawn apart
