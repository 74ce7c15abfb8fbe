"""Runs tests/multidevice in a fresh process that sees 8 CPU devices (XLA flags are read at start)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xdist_group("multidevice")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_meshes_and_shardings_on_8_fake_devices(request):
  flags = os.environ.get("XLA_FLAGS", "")  # tests/conftest.py's compile settings, and 8 devices
  env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip())
  env.pop("PYTEST_XDIST_WORKER", None)
  # The outer run's marker selection holds inside too (`make test` leaves the slow ones out).
  markers = request.config.getoption("markexpr")
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-p", "no:xdist", *(["-m", markers] if markers else []),
                         str(ROOT / "tests" / "multidevice")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
