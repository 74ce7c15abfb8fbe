"""Two CPU processes on localhost train one model together through jax.distributed."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE, QUIET, TINY_MODEL

pytestmark = pytest.mark.xdist_group("distributed")


@contextlib.contextmanager
def _reserved_port():
  """A port no other process can take while the block runs, yet the coordinator can bind.

  jax.distributed cannot bind port 0 and tell the others (every process must be given the port),
  and a port found free then released can be taken before process 0 binds it. So a socket holds
  it, bound but not listening, with SO_REUSEPORT: the kernel then refuses the port to any other
  bind (and never picks it for an ephemeral one), except to a socket of this user that sets
  SO_REUSEPORT too, as the coordinator's gRPC server does. It binds [::]:port (jax.distributed's
  default coordinator_bind_address), hence the dual-stack wildcard here.
  """
  with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as held:
    held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind(("::", 0))
    yield held.getsockname()[1]


def test_two_processes_train_together(tmp_path):
  env = dict(os.environ, XLA_FLAGS=FAST_COMPILE)  # one CPU device each
  with _reserved_port() as port:
    with socket.socket() as other, pytest.raises(OSError, match="in use"):
      other.bind(("127.0.0.1", port))  # held: no other process can take it before process 0
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
  from runner.checkpoints import checkpoint
  params, config, step = checkpoint.load_params(str(tmp_path))
  assert step == 3 and config["distributed"]["num_processes"] == 2
  assert params["head"]["kernel"].shape == (32, 10)
