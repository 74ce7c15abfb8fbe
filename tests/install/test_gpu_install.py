"""`make install GPU=auto|cuda12|cuda13`: JAX's CUDA builds at constraints.txt's versions resolve
together with the rest of the pinned set, and everything a build adds to JAX's CPU install (its
plugin, and the NVIDIA libraries: CUDA, cuDNN, cuBLAS, NCCL...) is pinned there, so that two
installs a month apart get the same CUDA. Checked with pip's resolver (`--dry-run`, reading the
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


def _resolve(extra: str) -> tuple[int, dict, str]:
  """(pip's exit code, name -> version it would install of jax[extra], its stderr)."""
  proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                         "--quiet", "--disable-pip-version-check", "--report", "-",
                         "-c", str(CONSTRAINTS), f"jax[{extra}]" if extra else "jax"],
                        capture_output=True, text=True, timeout=600)
  if proc.returncode:
    return proc.returncode, {}, proc.stderr
  report = json.loads(proc.stdout)
  return 0, {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
             for item in report["install"]}, proc.stderr


def test_each_cuda_build_resolves_with_everything_it_adds_pinned():
  pins = {name.replace("_", "-"): version for name, version in _pins().items()}
  assert {f"jax-{b}-{part}" for b in BUILDS for part in ("plugin", "pjrt")} <= set(pins)
  with concurrent.futures.ThreadPoolExecutor(len(BUILDS) + 1) as pool:
    results = dict(zip(("", *BUILDS), pool.map(_resolve, ("", *BUILDS))))
  for build, (code, versions, err) in results.items():
    if code and _UNREACHABLE.search(err):
      pytest.skip(f"the package registry cannot be reached: {err.strip().splitlines()[-1]}")
    assert code == 0, (build or "jax", err[-3000:])
  cpu = results[""][1]
  for build in BUILDS:
    versions = results[build][1]
    for package in ("jax", "jaxlib", f"jax-{build}-plugin", f"jax-{build}-pjrt"):
      assert versions[package] == pins[package], (build, package, versions.get(package))
    added = {name: version for name, version in versions.items() if name not in cpu}
    assert any(name.startswith("nvidia-") for name in added), (build, added)  # the CUDA libraries
    unpinned = {name: version for name, version in added.items() if pins.get(name) != version}
    assert not unpinned, (f"jax[{build}] pulls packages constraints.txt does not pin (at these "
                          f"versions): pin them under its {build} comment: " +
                          ", ".join(f"{n}=={v}" for n, v in sorted(unpinned.items())))
