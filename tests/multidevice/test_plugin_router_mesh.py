"""A plug-in router family under expert parallelism: `vmoe pretrain plugins=[switch_router]
sharding=ep` on 8 (fake CPU) devices, one expert per device, trains as on one device (the same
losses each step and the same final parameters). The plug-in's plan has the routing groups first,
so the layer shards it like the tokens; nothing in the family knows about meshes.

Runs in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/integration/test_multidevice.py starts it); skipped anywhere else. Each `vmoe` command
runs in a process of its own (registering the plug-in changes the schema of the process that
loads it); the one-device run's process is started without the 8-device flag.
"""
from __future__ import annotations

import base64
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import QUIET, TINY_MODEL

pytestmark = pytest.mark.skipif(jax.device_count() != 8,
                                reason="needs 8 devices (run via test_multidevice.py)")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples/plugins/switch_router.py"
# 64 images: 8 per device, one routing group of 8 images each, as on one device.
TRAIN = ["plugins=[switch_router]", "model=vmoe_tiny", "model.router.type=switch",
         "model.router.z_loss_weight=0.001", *TINY_MODEL,
         *QUIET, "train.steps=3", "schedule.warmup_steps=0", "train.log_every_steps=1",
         "data.batch_size=64",
         "eval.every_steps=0", "checkpoint.every_steps=0"]
EIGHT = "--xla_force_host_platform_device_count=8"


def _pretrain(cwd: pathlib.Path, workdir: pathlib.Path, *args: str,
              one_device: bool) -> subprocess.Popen:
  """Starts `vmoe pretrain` (both runs go at once: most of each is a single-threaded compile);
  its stderr goes to `workdir`.err."""
  env = dict(os.environ)
  if one_device:
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(EIGHT, "").strip()
  with open(f"{workdir}.err", "w") as err:
    return subprocess.Popen([sys.executable, "-m", "runner.cli", "pretrain",
                             f"workdir={workdir}", *TRAIN, *args], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=err)


def _losses(workdir: pathlib.Path) -> list[dict]:
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  keys = ("train/loss", "train/cls_loss", "moe/layer_1/load_balancing_loss",
          "moe/layer_1/z_loss", "moe/layer_1/fraction_dropped_tokens")
  return [{k: r[k] for k in ("step", *keys)} for r in records if "train/loss" in r]


def _saved_sharding(workdir: pathlib.Path, step: int) -> dict[str, tuple[list, list]]:
  """name -> (mesh shape, partition spec) of each saved parameter, from Orbax's metadata."""
  stored = json.loads((workdir / "checkpoints" / str(step) / "params" / "_sharding").read_text())
  out = {}
  for name, value in stored.items():
    value = json.loads(value) if isinstance(value, str) else value
    out[base64.b64decode(name).decode()] = (value["shape"], value["partition_spec"])
  return out


def test_plugin_router_trains_under_expert_parallelism_as_on_one_device(tmp_path):
  shutil.copy(EXAMPLE, tmp_path / EXAMPLE.name)
  ep, one = tmp_path / "ep", tmp_path / "one"
  runs = [_pretrain(tmp_path, ep, "sharding=ep", one_device=False),
          _pretrain(tmp_path, one, one_device=True)]
  try:
    for proc, workdir in zip(runs, (ep, one)):
      assert proc.wait(timeout=600) == 0, pathlib.Path(f"{workdir}.err").read_text()[-3000:]
  finally:
    for proc in runs:
      proc.kill()  # only a run left behind by a failure: a finished one is not signalled

  # The expert-parallel run's experts lived on an expert axis of all 8 devices.
  saved = _saved_sharding(ep, 3)
  assert saved["block_1.moe.experts.fc1_kernel"] == ([1, 8], ["expert", None, None])
  assert _saved_sharding(one, 3)["block_1.moe.experts.fc1_kernel"][0] == [1, 1]

  got, expected = _losses(ep), _losses(one)
  assert [r["step"] for r in got] == [r["step"] for r in expected] == [1, 2, 3]
  for a, b in zip(got, expected):
    for key in a:
      assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)

  from runner.checkpoints import weights
  params_ep, params_one = weights.load(str(ep))[0], weights.load(str(one))[0]
  assert jax.tree.structure(params_ep) == jax.tree.structure(params_one)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params_ep)[0],
                          jax.tree.leaves(params_one)):
    a, b, name = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
    if name.endswith("['qkv_bias']"):  # (q, k, v) biases: the key's gradient is exactly zero
      # (softmax ignores a shift shared by every key), so Adam turns the two runs' different
      # float noise there into updates of up to about 1e-5: it says nothing of the mesh.
      a, b = a[[0, 2]], b[[0, 2]]
    # atol: as in test_meshes.py; everything else agrees to rounding.
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
  assert params_ep["block_1"]["moe"]["router"]["dense"]["kernel"].shape == (32, 8)
