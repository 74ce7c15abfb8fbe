"""logger.wandb.mode=online on a machine that cannot use the W&B server falls back to offline.

Each case must end, offline run created and one warning printed, well within 30 s.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest
import wandb

from runner.config.schema import WandbConfig, WandbMode
from runner.logging import MetricWriter

API_KEY = "a" * 40


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
  """A W&B session with no settings, no netrc, and no key, reading this test's environment."""
  monkeypatch.delenv("WANDB_MODE", raising=False)  # conftest disables W&B for other tests
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.setenv("WANDB_SILENT", "true")
  for var, name in [("HOME", "home"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_DIR", "dir"),
                    ("WANDB_CACHE_DIR", "cache"), ("NETRC", "home/.netrc")]:
    monkeypatch.setenv(var, str(tmp_path / name))
  (tmp_path / "home").mkdir()
  wandb.teardown()  # W&B reads the environment once per session
  yield monkeypatch
  wandb.teardown()


def _closed_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_online(workdir, capfd) -> tuple[float, list[str]]:
  """Starts, logs to and closes an online MetricWriter; returns (seconds to start, warnings)."""
  capfd.readouterr()
  start = time.monotonic()
  writer = MetricWriter(str(workdir), run_config={"seed": 0},
                        wandb=WandbConfig(mode=WandbMode.online, project="vmoe-test"))
  elapsed = time.monotonic() - start
  writer.write(1, {"train/loss": 0.5})
  writer.close()
  err = capfd.readouterr().err
  assert len(list((workdir / "wandb").glob("offline-run-*"))) == 1, err
  assert (workdir / "metrics.jsonl").read_text().count("\n") == 1
  return elapsed, [line for line in err.splitlines() if "warning" in line.lower()]


def test_unreachable_server_falls_back_to_offline(wandb_env, tmp_path, capfd):
  wandb_env.setenv("WANDB_API_KEY", API_KEY)
  wandb_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
  elapsed, warnings = _run_online(tmp_path / "run", capfd)
  assert len(warnings) == 1, warnings
  assert "is unreachable (connection refused); logging offline" in warnings[0]
  assert f"wandb sync {tmp_path / 'run'}/wandb/offline-run-*" in warnings[0]
  assert elapsed < 30


def test_no_api_key_falls_back_to_offline(wandb_env, tmp_path, capfd):
  with socket.socket() as server:  # reachable, so only the missing key stops the online run
    server.bind(("127.0.0.1", 0))
    server.listen()
    wandb_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    elapsed, warnings = _run_online(tmp_path / "run", capfd)
  assert len(warnings) == 1, warnings
  assert "no API key configured" in warnings[0] and "logging offline" in warnings[0]
  assert elapsed < 30


def test_server_that_never_answers_falls_back_within_30s(wandb_env, tmp_path, capfd):
  with socket.socket() as server:  # accepts connections (the kernel does) but never reads
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    wandb_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    wandb_env.setenv("WANDB_API_KEY", API_KEY)
    elapsed, warnings = _run_online(tmp_path / "run", capfd)
  assert len(warnings) == 1, warnings
  assert "could not start an online run" in warnings[0] and "logging offline" in warnings[0]
  assert elapsed < 30


def test_probe_gives_up_on_a_hanging_dns_lookup(monkeypatch):
  from runner.logging import wandb_run
  monkeypatch.setattr(wandb_run, "PROBE_TIMEOUT_S", 0.2)
  hang = threading.Event()

  def hanging_lookup(*args, **kwargs):
    hang.wait(5)  # a DNS lookup that does not answer, then fails
    raise OSError("name or service not known")
  monkeypatch.setattr(socket, "create_connection", hanging_lookup)
  start = time.monotonic()
  assert wandb_run._unreachable("https://api.example.invalid") == "no connection within 0.2 s"
  assert time.monotonic() - start < 1
  hang.set()
