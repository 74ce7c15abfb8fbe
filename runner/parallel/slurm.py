"""Whether this machine can submit to SLURM, asked before a sweep is handed to submitit (which
otherwise fails after composing every job, with sbatch's message inside its traceback)."""
from __future__ import annotations

import shutil
import subprocess

_TIMEOUT_S = 30


def submission_problem(partition: str | None) -> str | None:
  """Why `sbatch` would fail here (no SLURM, no controller, an unknown partition), or None."""
  if not shutil.which("sbatch") or not shutil.which("sinfo"):
    return "SLURM's sbatch and sinfo are not on this machine's PATH"
  try:
    done = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True,
                          timeout=_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    return f"sinfo did not answer within {_TIMEOUT_S} s (is the SLURM controller up?)"
  if done.returncode:
    lines = (done.stderr or done.stdout).strip().splitlines()
    return f"sinfo failed ({lines[-1] if lines else f'exit code {done.returncode}'})"
  partitions = sorted(set(done.stdout.split()))
  if partition and partition not in partitions:
    return (f"SLURM has no partition {partition!r} (hydra.launcher.partition); its partitions: "
            f"{', '.join(partitions) or 'none'}")
  return None
