"""What a run writes about itself as it starts: its config (config.yaml, what later stages read)
and what it ran on (environment.json): the vmoe commit, the versions of the libraries that decide
its numbers, the devices, the host and Python. A run's report page shows both
(runner/report/workdir.py); without them a number cannot be traced back."""
from __future__ import annotations

import importlib.metadata
import json
import pathlib
import platform
import socket
import subprocess

import jax
import yaml

from runner import accelerator
from runner.config import as_dict

FILE = "environment.json"
# The libraries whose versions change what a run computes or how fast.
PACKAGES = ("vmoe", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy",
            "tensorflow-cpu", "tensorflow", "tensorflow-datasets")


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _git_commit() -> str | None:
  """The commit vmoe runs from ("+changes" where its files differ), or None outside a checkout."""
  root = pathlib.Path(__file__).resolve().parents[2]
  if not (root / ".git").exists():
    return None
  try:
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                            text=True, timeout=5, check=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=5, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return commit + (" +changes" if changed else "")


def devices() -> str:
  """'8 x NVIDIA H100 80GB HBM3 (gpu)': what the run computes on."""
  found = jax.devices()
  kinds = sorted({d.device_kind for d in found})
  return f"{len(found)} x {', '.join(kinds)} ({jax.default_backend()})"


def gpu_not_found() -> str | None:
  """Why a CUDA install runs on the CPU, or None: said as a stage starts, so that a run that fell
  back to the CPU is seen at once rather than from its speed. A CPU install says nothing."""
  if jax.default_backend() != "cpu":
    return None
  installed = accelerator.installed_build()
  if installed is None:
    return None
  build, version = installed
  return (f"jax-{build}-plugin {version} is installed, but JAX found no GPU and runs on the CPU: "
          f"{accelerator.gpu_problem()}")


def describe() -> dict:
  return {"git_commit": _git_commit(),
          "packages": {p: v for p in PACKAGES if (v := _version(p)) is not None},
          "devices": devices(), "processes": jax.process_count(), "host": socket.gethostname(),
          "python": platform.python_version(), "platform": platform.platform()}


def write_config(config, workdir: str) -> None:
  """config.yaml and environment.json in `workdir` (by the first process: the workdir is shared)."""
  if jax.process_index():
    return
  path = pathlib.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.yaml").write_text(yaml.safe_dump(as_dict(config), sort_keys=False))
  (path / FILE).write_text(json.dumps(describe(), indent=1) + "\n")
