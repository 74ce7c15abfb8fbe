"""Two CPU processes on localhost train one model together through jax.distributed."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE, QUIET, TINY_MODEL

pytestmark = pytest.mark.xdist_group("distributed")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_train_together(tmp_path):
  port = _free_port()
  env = dict(os.environ, XLA_FLAGS=FAST_COMPILE)  # one CPU device each
  common = ["pretrain", f"workdir={tmp_path}", *TINY_MODEL, *QUIET, "train.steps=3",
            "schedule.warmup_steps=0",
            "train.log_every_steps=1", "checkpoint.every_steps=2", "data.batch_size=32",
            f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2"]
  procs = [subprocess.Popen([sys.executable, "-m", "runner.cli", *common,
                             f"distributed.process_id={i}", "logger.progress=true"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outputs = [p.communicate(timeout=600) for p in procs]
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]
  # Process 0 reports a 2-device job; only it writes metrics (one record per step, not two).
  assert "on 2 device(s)" in outputs[0][1]
  assert "on 2 device(s)" not in outputs[1][1]
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["step"] == 3 and 0 <= summary["val/prec@1"] <= 1
  # The checkpoint written by both processes restores (here, in a single process).
  from runner import checkpoint
  params, config, step = checkpoint.load_params(str(tmp_path))
  assert step == 3 and config["distributed"]["num_processes"] == 2
  assert params["head"]["kernel"].shape == (32, 10)
