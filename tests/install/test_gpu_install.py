"""`make install GPU=cuda12|cuda13`: JAX's CUDA builds at constraints.txt's versions resolve
together with the rest of the pinned set. Checked with pip's resolver (`--dry-run`, reading the
packages' metadata), so the NVIDIA libraries are not downloaded; skipped where the package
registry cannot be reached."""
from __future__ import annotations

import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
BUILDS = ("cuda12", "cuda13")
# What pip says when it cannot reach the registry, as opposed to pins that do not fit together.
_UNREACHABLE = re.compile(r"NewConnectionError|ConnectTimeout|Temporary failure in name "
                          r"resolution|Network is unreachable|No matching distribution found "
                          r"for jax\[")


def _pins() -> dict[str, str]:
  pins = {}
  for line in CONSTRAINTS.read_text().splitlines():
    name, eq, version = line.split("#")[0].strip().partition("==")
    if eq:
      pins[name.lower()] = version
  return pins


def _resolve(build: str) -> tuple[int, dict, str]:
  """(pip's exit code, name -> version it would install, its stderr)."""
  proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                         "--quiet", "--disable-pip-version-check", "--report", "-",
                         "-c", str(CONSTRAINTS), f"jax[{build}]"],
                        capture_output=True, text=True, timeout=600)
  if proc.returncode:
    return proc.returncode, {}, proc.stderr
  report = json.loads(proc.stdout)
  return 0, {item["metadata"]["name"].lower(): item["metadata"]["version"]
             for item in report["install"]}, proc.stderr


def test_each_cuda_build_resolves_at_the_pinned_versions():
  pins = _pins()
  assert {f"jax-{b}-{part}" for b in BUILDS for part in ("plugin", "pjrt")} <= set(pins)
  with concurrent.futures.ThreadPoolExecutor(len(BUILDS)) as pool:
    results = dict(zip(BUILDS, pool.map(_resolve, BUILDS)))
  for build, (code, versions, err) in results.items():
    if code and _UNREACHABLE.search(err):
      pytest.skip(f"the package registry cannot be reached: {err.strip().splitlines()[-1]}")
    assert code == 0, (build, err[-3000:])
    for package in ("jax", "jaxlib", f"jax-{build}-plugin", f"jax-{build}-pjrt"):
      assert versions[package] == pins[package], (build, package, versions.get(package))
    assert any(name.startswith("nvidia-") for name in versions), build  # the CUDA libraries
