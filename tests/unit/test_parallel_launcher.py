"""hydra/launcher=parallel: how jobs share the machine and how each is started (the launcher
itself runs in tests/integration/test_sweeps.py, and in tests/cluster/test_slurm.py, jobs at
once)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hydra_plugins.vmoe_launchers.parallel_launcher import ParallelLauncher, gpu_ids, shares
from hydra_plugins.vmoe_launchers.pinned_job import CPUS_VARIABLE


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


def test_a_job_is_spawned_and_told_its_cores_and_its_sweep(monkeypatch):
  # A preexec_fn would make subprocess fork this multi-threaded process (JAX warns that it may
  # deadlock); the job pins itself from VMOE_CPUS instead.
  started = []
  monkeypatch.setattr(subprocess, "Popen", lambda command, **kwargs: started.append(kwargs))
  monkeypatch.setenv(CPUS_VARIABLE, "7")  # this process's own, never handed on as it is
  ParallelLauncher._start(["vmoe"], {"env": {}, "cpus": {3, 2}}, {"VMOE_SWEEP_JOB": "{}"}, None)
  ParallelLauncher._start(["vmoe"], {"env": {"CUDA_VISIBLE_DEVICES": "1"}, "cpus": None}, {},
                          None)
  pinned, on_a_gpu = started
  assert pinned.get("preexec_fn") is None and on_a_gpu.get("preexec_fn") is None
  assert pinned["env"][CPUS_VARIABLE] == "2,3" and pinned["env"]["VMOE_SWEEP_JOB"] == "{}"
  assert CPUS_VARIABLE not in on_a_gpu["env"] and on_a_gpu["env"]["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_job_pins_itself_and_its_later_threads_to_the_given_cores():
  core = max(os.sched_getaffinity(0))
  script = ("from hydra_plugins.vmoe_launchers.pinned_job import pin_to_given_cpus\n"
            "pin_to_given_cpus()\n"
            "import os, threading\n"
            "seen = []\n"
            "thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))\n"
            "thread.start(); thread.join()\n"
            "print(sorted(os.sched_getaffinity(0)), sorted(seen[0]))\n")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                       env={**os.environ, CPUS_VARIABLE: str(core)}).stdout
  assert out.split() == [f"[{core}]", f"[{core}]"]
