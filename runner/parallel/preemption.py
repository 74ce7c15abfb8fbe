"""What a job does after it saved a checkpoint on its scheduler's signal: SLURM preempts a job (or
warns it of its time limit, `--signal=USR1@...`) with a signal, as `scancel --signal=TERM <job>`
does by hand (plain `scancel` cancels it: SLURM marks it CANCELLED first). Then `requeue` puts a job
SLURM still runs back in the queue, to resume from that checkpoint; elsewhere it does nothing."""
from __future__ import annotations

import os
import shutil
import subprocess


def slurm_job_id() -> str | None:
  """This job's id as scontrol names it (array jobs: <array id>_<task id>), None outside SLURM."""
  array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
  if array and task:
    return f"{array}_{task}"
  return os.environ.get("SLURM_JOB_ID")


def requeue() -> str | None:
  """Requeues this SLURM job if SLURM still runs it; returns the job id requeued, or None."""
  job = slurm_job_id()
  if job is None or shutil.which("scontrol") is None:
    return None
  try:
    state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                           text=True, timeout=30).stdout.split()
    if state[:1] != ["RUNNING"]:  # cancelled, or already being requeued by SLURM itself
      return None
    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=60)
  except (OSError, subprocess.SubprocessError):
    return None
  return job
