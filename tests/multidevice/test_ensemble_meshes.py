"""A partitioned batch ensemble (E³) through the CLI on 8 (fake CPU) devices under expert
parallelism: pretrain, eval (with the routing analysis) and ensemble give the numbers a
data-parallel mesh gives.
(Training on meshes vs one device: test_meshes.py, for a V-MoE and a pBE alike.) Runs in its own
process with XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/integration/
test_multidevice.py starts it); skipped anywhere else.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import yaml

from conftest import QUIET, TINY_MODEL

pytestmark = pytest.mark.skipif(jax.device_count() != 8,
                                reason="needs 8 devices (run via test_multidevice.py)")

# vmoe_tiny with k=1 and M=2: 8 experts, two partitions of 4.
MODEL = "vmoe_tiny_k1_m2"


FAST = [*TINY_MODEL, *QUIET, "train.steps=2", "schedule.warmup_steps=0", "data.batch_size=64"]


def test_pbe_cli_pretrain_expert_parallel_then_evaluate(run_cli, tmp_path):
  code, _, err = run_cli("pretrain", f"workdir={tmp_path / 'up'}", f"model={MODEL}", *FAST,
                         "sharding=ep")
  assert code == 0, err
  config = yaml.safe_load((tmp_path / "up" / "config.yaml").read_text())
  assert config["sharding"]["name"] == "ep" and config["mesh"]["expert"] == -1
  assert config["model"]["moe"]["ensemble_size"] == 2
  metrics = (tmp_path / "up" / "metrics.jsonl").read_text().splitlines()
  lines = [json.loads(line) for line in metrics]
  assert all(np.isfinite(r["train/loss"]) for r in lines if "train/loss" in r)
  # The expert-parallel checkpoint evaluated on a data-parallel mesh and on an expert one: the same
  # numbers (same batches, same groups), the routing analysis' too.
  summaries = []
  for name, args in (("dp", ["mesh.data=8"]), ("ep", ["sharding=ep"])):
    code, _, err = run_cli("eval", f"init.checkpoint={tmp_path / 'up'}",
                           f"workdir={tmp_path / name}", *QUIET, *args,
                           "eval.routing_analysis=true", "eval.routing.images=2")
    assert code == 0, err
    summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
  dp, ep = summaries
  assert ep["ensemble/size"] == 2
  for key in ("mnist5k/prec@1", "mnist5k/nll", "mnist5k/member_0/nll", "mnist5k/member_1/nll",
              "mnist5k/diversity/kl"):
    assert ep[key] == pytest.approx(dp[key], rel=1e-5, abs=1e-7), key
  routing = sorted(k for k, v in ep.items() if k.startswith("routing/") and isinstance(v, float))
  assert any("member_1" in k for k in routing) and any("top1" in k for k in routing), routing
  for key in routing:
    assert ep[key] == pytest.approx(dp[key], rel=1e-4, abs=1e-6), key
  analysis = [dict(np.load(tmp_path / name / "routing_analysis.npz")) for name in ("dp", "ep")]
  assert analysis[0].keys() == analysis[1].keys()
  for key, value in analysis[0].items():
    np.testing.assert_allclose(analysis[1][key], value, rtol=1e-4, atol=1e-6, err_msg=key)
  code, _, err = run_cli("ensemble", f"init.checkpoint=[{tmp_path / 'up'}]",
                         f"workdir={tmp_path / 'ens'}", *QUIET, "sharding=ep")
  assert code == 0, err
  s = json.loads((tmp_path / "ens" / "summary.json").read_text())
  assert s["ensemble/type"] == "pbe" and s["ensemble/size"] == 2
  assert s["mnist5k/nll"] == pytest.approx(ep["mnist5k/nll"], rel=1e-6)
