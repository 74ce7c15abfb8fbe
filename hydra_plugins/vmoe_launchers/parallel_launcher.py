"""`hydra/launcher=parallel`: a sweep's jobs on this machine, several at a time, each pinned.

Each job is a fresh `vmoe <stage>` process with the job's overrides and its own workdir (the
folder Hydra would give it: the sweep dir and subdir), so no accelerator state is shared or
forked. With several GPUs, the jobs split them (CUDA_VISIBLE_DEVICES); otherwise each job is
pinned to its share of the CPU cores, which it does itself as it starts (pinned_job.py), so that
this multi-threaded process is never forked. To Hydra the job is a plain run: the launcher tells it
that it is a job of the sweep (runner.command.job.SWEEP_JOB_VARIABLE), so that its W&B run joins the
sweep's group as a job of the basic launcher does. A job's return value, what the optuna sweeper
optimises, is its stage's main metric read from its summary.json.
"""

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import time
from typing import Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from omegaconf import OmegaConf, open_dict

from hydra_plugins.vmoe_launchers.pinned_job import CPUS_VARIABLE

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ParallelLauncherConf:
  _target_: str = "hydra_plugins.vmoe_launchers.parallel_launcher.ParallelLauncher"
  jobs: int = 2  # jobs running at once
  pin: bool = True  # each job on its own GPUs, or CPU cores


ConfigStore.instance().store(group="hydra/launcher", name="vmoe_parallel",
                             node=ParallelLauncherConf, provider="vmoe")


def gpu_ids() -> list:
  """The GPUs this process may use: CUDA_VISIBLE_DEVICES, else what nvidia-smi lists."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return [g for g in visible.split(",") if g.strip()]
  if shutil.which("nvidia-smi") is None:
    return []
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.SubprocessError):
    return []
  return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def shares(items: list, parts: int) -> list:
  """`items` in `parts` contiguous shares as even as possible (each at least one item when
  there are enough)."""
  parts = max(1, min(parts, len(items))) if items else max(1, parts)
  if not items:
    return [[] for _ in range(parts)]
  size, extra = divmod(len(items), parts)
  out, start = [], 0
  for i in range(parts):
    end = start + size + (i < extra)
    out.append(items[start:end])
    start = end
  return out


class ParallelLauncher(Launcher):

  def __init__(self, jobs: int = 2, pin: bool = True) -> None:
    if jobs < 1:
      raise ValueError(f"hydra.launcher.jobs={jobs}: run at least one job at a time")
    self.jobs, self.pin = int(jobs), bool(pin)
    self.config = self.hydra_context = self.task_function = None

  def setup(self, *, hydra_context, task_function, config) -> None:
    self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

  def _slots(self) -> list:
    """One environment change (and CPU set) per concurrent job."""
    gpus = gpu_ids() if self.pin else []
    if len(gpus) >= 2:
      return [{"env": {"CUDA_VISIBLE_DEVICES": ",".join(share)}, "cpus": None}
              for share in shares(gpus, self.jobs)]
    cpus = sorted(os.sched_getaffinity(0)) if self.pin and hasattr(os, "sched_getaffinity") else []
    if cpus:
      return [{"env": {}, "cpus": set(share)} for share in shares(cpus, self.jobs)]
    return [{"env": {}, "cpus": None} for _ in range(self.jobs)]

  def _job_dir(self, overrides: Sequence[str], num: int):
    """The job's config (as a sweep job), the sweep's folder and the job's: sweep dir / subdir."""
    sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config,
                                                                      list(overrides))
    with open_dict(sweep_config.hydra.job):
      sweep_config.hydra.job.num = num
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(sweep_config)  # for ${hydra:...} in the subdir
    try:
      sweep_dir = str(sweep_config.hydra.sweep.dir)
      subdir = str(OmegaConf.select(sweep_config, "hydra.sweep.subdir"))
      directory = pathlib.Path(sweep_dir) / subdir
    finally:
      if previous is not None:
        HydraConfig.instance().set_config(previous)
    return sweep_config, sweep_dir, directory

  def _command(self, overrides: Sequence[str], workdir: pathlib.Path) -> list[str]:
    """`vmoe <stage>` (pinned_job.py) with the sweep's config source and this job's overrides
    and workdir."""
    stage = os.environ.get("VMOE_STAGE")
    if not stage:
      raise RuntimeError("hydra/launcher=parallel runs vmoe stages: start it with the vmoe CLI")
    runtime = self.config.hydra.runtime
    primary = next((s.path for s in runtime.config_sources if s.provider == "main"), None)
    command = [sys.executable, "-m", "hydra_plugins.vmoe_launchers.pinned_job", stage]
    if primary and primary.startswith("file://"):
      command += ["-cd", primary[len("file://"):]]
    command += ["-cn", str(self.config.hydra.job.config_name)]
    return command + list(overrides) + [f"workdir={workdir}"]

  @staticmethod
  def _start(command: list[str], slot: dict, environment: dict, logfile) -> subprocess.Popen:
    """The job's process, spawned: no preexec_fn, which would fork this multi-threaded process;
    the job pins itself to the slot's cores."""
    env = {**os.environ, **slot["env"], **environment}
    env.pop(CPUS_VARIABLE, None)
    if slot["cpus"]:
      env[CPUS_VARIABLE] = ",".join(str(cpu) for cpu in sorted(slot["cpus"]))
    return subprocess.Popen(command, stdout=logfile, stderr=subprocess.STDOUT, env=env)

  def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
             ) -> Sequence[JobReturn]:
    # lazily: Hydra imports this plug-in at every start, and runner.command.job brings the library
    from runner.command.job import SWEEP_JOB_VARIABLE
    from runner.config.subcommands import main_metric
    slots = self._slots()
    pending = list(enumerate(job_overrides, start=initial_job_idx))
    running = {}  # slot -> (process, job number, overrides, config, dir, log)
    done = {}
    free = list(range(len(slots)))
    log.info(f"Parallel launcher: {len(pending)} job(s), {len(slots)} at a time")
    while pending or running:
      while pending and free:
        slot = free.pop(0)
        num, overrides = pending.pop(0)
        sweep_config, sweep_dir, workdir = self._job_dir(overrides, num)
        workdir.mkdir(parents=True, exist_ok=True)
        logfile = open(workdir / "launcher.log", "w")
        cpus = slots[slot]["cpus"]
        identity = json.dumps({"sweep_dir": sweep_dir, "overrides": list(overrides)})
        process = self._start(self._command(overrides, workdir), slots[slot],
                              {SWEEP_JOB_VARIABLE: identity}, logfile)
        log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))} -> {workdir}"
                 + (f" (cpus {sorted(cpus)})" if cpus else "")
                 + (f" (gpus {slots[slot]['env']['CUDA_VISIBLE_DEVICES']})"
                    if slots[slot]["env"] else ""))
        running[slot] = (process, num, list(overrides), sweep_config, workdir, logfile)
      time.sleep(0.2)
      for slot, (process, num, overrides, sweep_config, workdir, logfile) in list(running.items()):
        code = process.poll()
        if code is None:
          continue
        logfile.close()
        del running[slot]
        free.append(slot)
        ret = JobReturn(overrides=overrides, working_dir=str(workdir),
                        cfg=sweep_config, hydra_cfg=None,
                        task_name=str(self.config.hydra.job.name))
        if code == 0:
          summary = json.loads((workdir / "summary.json").read_text())
          ret.status, ret.return_value = JobStatus.COMPLETED, main_metric(
              os.environ["VMOE_STAGE"], summary)
        else:
          ret.status = JobStatus.FAILED
          ret.return_value = RuntimeError(
              f"job #{num} ({' '.join(filter_overrides(overrides))}) exited with code {code}; "
              f"its output is in {workdir / 'launcher.log'}")
        done[num] = ret
    return [done[num] for num in sorted(done)]

