"""The cluster tests' SLURM (tests/cluster/slurm_cluster.py): started once, stopped at the end."""
from __future__ import annotations

import pathlib
import sys
import tempfile

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import slurm_cluster  # noqa: E402


@pytest.fixture(scope="session")
def slurm():
  root = pathlib.Path(tempfile.mkdtemp(prefix="vmoe-slurm-"))
  try:
    cluster = slurm_cluster.start(root)
  except slurm_cluster.Unavailable as e:
    pytest.skip(f"no SLURM cluster on this machine: {e}")
  yield cluster
  cluster.stop()
