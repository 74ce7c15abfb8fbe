"""Runs tests/multidevice in fresh processes that see 8 CPU devices (XLA flags are read at start).

Two processes, each half of the modules and an xdist group of its own, so that `make test`'s two
workers can share the 8-device work rather than one of them carrying all of it.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HALVES = {
    "meshes": ["test_meshes.py", "test_ensemble_meshes.py"],
    "cli": ["test_cli_mesh.py", "test_contrastive_meshes.py", "test_plugin_router_mesh.py",
            "test_dropless_mesh.py"],
}


def test_the_halves_cover_every_module():
  modules = sorted(p.name for p in (ROOT / "tests" / "multidevice").glob("test_*.py"))
  assert sorted(m for half in HALVES.values() for m in half) == modules


@pytest.mark.parametrize("half", [pytest.param(name, marks=pytest.mark.xdist_group(
    f"multidevice_{name}")) for name in HALVES])
def test_meshes_and_shardings_on_8_fake_devices(half, request):
  flags = os.environ.get("XLA_FLAGS", "")  # tests/conftest.py's compile settings, and 8 devices
  env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip())
  env.pop("PYTEST_XDIST_WORKER", None)
  # The outer run's marker selection holds inside too (`make test` leaves the slow ones out).
  markers = request.config.getoption("markexpr")
  modules = [str(ROOT / "tests" / "multidevice" / m) for m in HALVES[half]]
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-p", "no:xdist", *(["-m", markers] if markers else []), *modules],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
