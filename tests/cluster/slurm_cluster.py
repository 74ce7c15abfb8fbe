"""A real single-node SLURM cluster on this machine, for the cluster tests.

Debian's slurm-wlm and munge, started as root with every file in one temporary folder: munged
with a fresh key and its own socket, slurmctld and slurmd with a slurm.conf naming this host (one
node of all its CPUs, one partition, no accounting), on ports of their own. `start` installs the
packages when apt is there; `stop` ends exactly the daemons it started (by their pid files).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue", "sinfo", "scancel")


class Unavailable(RuntimeError):
  """This machine cannot run the cluster (the reason is the message)."""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("", 0))
    return s.getsockname()[1]


def install() -> None:
  """Installs slurm-wlm and munge with apt when they are missing (root only)."""
  if all(shutil.which(d) for d in DAEMONS):
    return
  if os.geteuid() != 0:
    raise Unavailable("SLURM is not installed and installing it needs root")
  if not shutil.which("apt-get"):
    raise Unavailable("SLURM is not installed and there is no apt-get to install it")
  env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
  command = ["apt-get", "install", "-y", "-q", *PACKAGES]
  if subprocess.run(command, env=env, capture_output=True).returncode:
    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
      raise Unavailable(f"apt-get install {' '.join(PACKAGES)} failed: "
                        f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")


@dataclasses.dataclass
class Cluster:
  root: pathlib.Path
  env: dict  # what a client command needs (SLURM_CONF)

  def run(self, *command: str, check: bool = True, timeout: float = 60) -> str:
    done = subprocess.run(command, env={**os.environ, **self.env}, capture_output=True,
                          text=True, timeout=timeout)
    if check and done.returncode:
      raise RuntimeError(f"{' '.join(command)}: {done.stderr or done.stdout}")
    return done.stdout

  def jobs(self) -> list[dict]:
    """Every job SLURM still knows: id, state, name."""
    out = self.run("squeue", "-h", "-o", "%i|%T|%j|%r")
    return [dict(zip(("id", "state", "name", "reason"), line.split("|")))
            for line in out.splitlines() if line.strip()]

  def drained(self, timeout: float = 60) -> list[dict]:
    """The jobs still queued once the queue empties or `timeout` seconds pass. A job whose
    result submitit has already read can show RUNNING for a moment while its step and epilog
    end; a job really left behind is still there after a minute."""
    deadline = time.monotonic() + timeout
    while (jobs := self.jobs()) and time.monotonic() < deadline:
      time.sleep(1)
    return jobs

  def job(self, job_id: str) -> dict:
    """`scontrol show job` of one job as a dict (JobState, Reason, Restarts, ...); {} once SLURM
    no longer knows it."""
    out = self.run("scontrol", "show", "job", "-o", job_id, check=False)
    return dict(field.split("=", 1) for field in out.split() if "=" in field)

  def stop(self) -> None:
    for name in ("slurmd", "slurmctld", "munged"):
      pid_file = self.root / f"{name}.pid"
      try:
        os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
      except (OSError, ValueError):
        pass
    time.sleep(1)


def start(root: pathlib.Path, *, timeout: float = 60) -> Cluster:
  """Starts munged, slurmctld and slurmd under `root`; waits until the node is idle."""
  if os.geteuid() != 0:
    raise Unavailable("starting SLURM's daemons needs root")
  install()
  host = socket.gethostname().split(".")[0]
  for d in ("munge", "state", "spool", "log"):
    (root / d).mkdir(parents=True, exist_ok=True)
  os.chmod(root / "munge", 0o700)
  key = root / "munge" / "munge.key"
  key.write_bytes(os.urandom(1024))
  os.chmod(key, 0o400)
  munge_socket = root / "munge" / "munge.socket"
  subprocess.run(["munged", "--force", f"--socket={munge_socket}", f"--key-file={key}",
                  f"--log-file={root / 'log' / 'munged.log'}",
                  f"--pid-file={root / 'munged.pid'}", f"--seed-file={root / 'munge' / 'seed'}"],
                 check=True, capture_output=True)
  conf = root / "slurm.conf"
  conf.write_text("\n".join([
      "ClusterName=vmoetest", f"SlurmctldHost={host}", "AuthType=auth/munge",
      "CredType=cred/munge", f"AuthInfo=socket={munge_socket}", "SlurmUser=root",
      f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
      "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
      "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
      "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
      "JobCompType=jobcomp/none", "MpiDefault=none", "ReturnToService=2",
      f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
      f"SlurmdSpoolDir={root / 'spool'}", f"StateSaveLocation={root / 'state'}",
      f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
      f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
      f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
      f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""]))
  cluster = Cluster(root, {"SLURM_CONF": str(conf)})
  env = {**os.environ, **cluster.env}
  try:
    subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True, capture_output=True)
    subprocess.run(["slurmd", "-f", str(conf)], env=env, check=True, capture_output=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
      state = cluster.run("sinfo", "-h", "-o", "%t", check=False).strip()
      if state == "idle":
        return cluster
      time.sleep(0.5)
    raise Unavailable(f"the SLURM node did not become idle within {timeout:g} s (sinfo: "
                      f"{state!r}); see {root / 'log'}")
  except (OSError, subprocess.CalledProcessError) as e:
    cluster.stop()
    raise Unavailable(f"SLURM's daemons did not start: {e}") from None
  except Unavailable:
    cluster.stop()
    raise
