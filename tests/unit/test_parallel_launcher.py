"""hydra/launcher=parallel: how jobs share the machine (the launcher itself runs in
tests/cluster/test_slurm.py, jobs at once)."""
from __future__ import annotations

import pytest

from hydra_plugins.vmoe_launchers.parallel_launcher import ParallelLauncher, gpu_ids, shares


@pytest.mark.parametrize("items,parts,expected", [
    ([0, 1], 2, [[0], [1]]),
    ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
    ([0, 1], 4, [[0], [1]]),  # never more shares than items
    (list(range(8)), 3, [[0, 1, 2], [3, 4, 5], [6, 7]]),
    ([], 2, [[], []]),
])
def test_shares_are_contiguous_and_even(items, parts, expected):
  got = shares(items, parts)
  assert got == expected
  assert sorted(x for s in got for x in s) == sorted(items)


def test_several_gpus_are_split_between_the_jobs(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
  assert gpu_ids() == ["0", "1", "2", "3"]
  slots = ParallelLauncher(jobs=2)._slots()
  assert [s["env"]["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0,1", "2,3"]
  assert all(s["cpus"] is None for s in slots)


def test_without_gpus_each_job_gets_its_cpu_cores(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
  monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
  slots = ParallelLauncher(jobs=2)._slots()
  assert [s["cpus"] for s in slots] == [{0, 1}, {2, 3}] and all(not s["env"] for s in slots)
  unpinned = ParallelLauncher(jobs=3, pin=False)._slots()
  assert len(unpinned) == 3 and all(s["cpus"] is None and not s["env"] for s in unpinned)


def test_at_least_one_job_at_a_time():
  with pytest.raises(ValueError, match="at least one job"):
    ParallelLauncher(jobs=0)
