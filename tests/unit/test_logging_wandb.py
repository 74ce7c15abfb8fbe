"""logger.wandb.mode=online on a machine that cannot use the W&B server falls back to offline.

Each case must end with the offline run created and one warning printed, having probed the server
at most once and tried online at most once, under its deadline: the probe's 8 s and the online
start's 12 s are what keep a fallback within 30 s (docs/reliability.md), whatever the machine.
"""
from __future__ import annotations

import socket
import threading

import pytest
import wandb

from runner.config.schema import WandbConfig, WandbMode
from runner.logging import MetricWriter, wandb_run

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


@pytest.fixture
def attempts(wandb_env) -> dict[str, list]:
  """The server probes (their URLs) and W&B run starts ((mode, init deadline)) made, each passed
  on to the real one."""
  made = {"probes": [], "starts": []}
  probe, init = wandb_run._unreachable, wandb.init

  def counted_probe(url):
    made["probes"].append(url)
    return probe(url)

  def counted_init(*args, **kwargs):
    made["starts"].append((kwargs["mode"], kwargs["settings"].init_timeout))
    return init(*args, **kwargs)

  wandb_env.setattr(wandb_run, "_unreachable", counted_probe)
  wandb_env.setattr(wandb, "init", counted_init)
  return made


def _run_online(workdir, capfd) -> list[str]:
  """Starts, logs to and closes an online MetricWriter; returns the warnings printed."""
  capfd.readouterr()
  writer = MetricWriter(str(workdir), run_config={"seed": 0},
                        wandb=WandbConfig(mode=WandbMode.online, project="vmoe-test"))
  writer.write(1, {"train/loss": 0.5})
  writer.close()
  err = capfd.readouterr().err
  assert len(list((workdir / "wandb").glob("offline-run-*"))) == 1, err
  assert (workdir / "metrics.jsonl").read_text().count("\n") == 1
  return [line for line in err.splitlines() if "warning" in line.lower()]


def test_the_deadlines_keep_a_fallback_within_30s():
  """The probe's and the online start's deadlines, plus the ~3 s W&B takes to restart offline
  (wandb_run's docstring), fit the 30 s docs/reliability.md promises."""
  assert (wandb_run.PROBE_TIMEOUT_S, wandb_run.INIT_TIMEOUT_S) == (8.0, 12.0)
  assert wandb_run.PROBE_TIMEOUT_S + wandb_run.INIT_TIMEOUT_S + 3 < 30


def test_unreachable_server_falls_back_to_offline(wandb_env, attempts, tmp_path, capfd):
  wandb_env.setenv("WANDB_API_KEY", API_KEY)
  url = f"http://127.0.0.1:{_closed_port()}"
  wandb_env.setenv("WANDB_BASE_URL", url)
  warnings = _run_online(tmp_path / "run", capfd)
  assert len(warnings) == 1, warnings
  assert "is unreachable (connection refused); logging offline" in warnings[0]
  assert f"wandb sync {tmp_path / 'run'}/wandb/offline-run-*" in warnings[0]
  # One probe, then straight to offline: no online start waits on a server known to be down.
  assert attempts["probes"] == [url]
  assert [mode for mode, _ in attempts["starts"]] == ["offline"]


def test_no_api_key_falls_back_to_offline(wandb_env, attempts, tmp_path, capfd):
  with socket.socket() as server:  # reachable, so only the missing key stops the online run
    server.bind(("127.0.0.1", 0))
    server.listen()
    wandb_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    warnings = _run_online(tmp_path / "run", capfd)
  assert len(warnings) == 1, warnings
  assert "no API key configured" in warnings[0] and "logging offline" in warnings[0]
  # Without a key nothing is asked of the server: neither a probe nor an online start.
  assert attempts["probes"] == []
  assert [mode for mode, _ in attempts["starts"]] == ["offline"]


def test_server_that_never_answers_falls_back_at_the_start_deadline(wandb_env, attempts,
                                                                    tmp_path, capfd):
  """The probe connects (the kernel accepts), so W&B starts online once, given INIT_TIMEOUT_S
  rather than its own 90 s, then offline once; a 2 s deadline keeps the test short."""
  wandb_env.setattr(wandb_run, "INIT_TIMEOUT_S", 2.0)
  with socket.socket() as server:  # accepts connections (the kernel does) but never reads
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    wandb_env.setenv("WANDB_BASE_URL", url)
    wandb_env.setenv("WANDB_API_KEY", API_KEY)
    warnings = _run_online(tmp_path / "run", capfd)
  assert len(warnings) == 1, warnings
  assert "could not start an online run" in warnings[0] and "logging offline" in warnings[0]
  assert attempts["probes"] == [url]
  assert attempts["starts"][0] == ("online", 2.0)
  assert [mode for mode, _ in attempts["starts"]] == ["online", "offline"]


def test_probe_gives_up_on_a_hanging_dns_lookup(monkeypatch):
  monkeypatch.setattr(wandb_run, "PROBE_TIMEOUT_S", 0.2)
  hang, answered = threading.Event(), threading.Event()

  def hanging_lookup(*args, **kwargs):
    hang.wait(10)  # a DNS lookup that does not answer (until the test lets it), then fails
    answered.set()
    raise OSError("name or service not known")
  monkeypatch.setattr(socket, "create_connection", hanging_lookup)
  try:
    assert wandb_run._unreachable("https://api.example.invalid") == "no connection within 0.2 s"
    assert not answered.is_set()  # it gave up at its deadline, not when the lookup ended
  finally:
    hang.set()
