"""Multi-host start-up through JAX's own runtime (`jax.distributed.initialize`).

Either from the config (`distributed.coordinator_address=host:port distributed.num_processes=n
distributed.process_id=i`), or from the environment JAX recognises (SLURM, TPU VMs, Kubernetes,
or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID), or not at all (one process).
Must run before anything touches a JAX device.
"""
from __future__ import annotations

import os

import jax

from runner.errors import ConfigError

_CLUSTER_VARIABLES = ("SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS",
                      "OMPI_COMM_WORLD_SIZE")


def _cluster_detected() -> bool:
  if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
    return False  # a single SLURM task: nothing to coordinate
  return any(os.environ.get(v) for v in _CLUSTER_VARIABLES)


def initialize(config: dict | None) -> None:
  """Joins the multi-process job described by `config` (the `distributed` keys) or the environment."""
  config = config or {}
  if jax.distributed.is_initialized():
    return
  address = config.get("coordinator_address")
  if address:
    num, pid = config.get("num_processes"), config.get("process_id")
    if num is None or pid is None or not 0 <= pid < num:
      raise ConfigError(f"distributed.coordinator_address={address} needs "
                        f"distributed.num_processes=<n> and distributed.process_id=<0..n-1>; got "
                        f"num_processes={num}, process_id={pid}.")
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid,
                               initialization_timeout=config.get("timeout_seconds", 300))
  elif config.get("auto", True) and _cluster_detected():
    jax.distributed.initialize(initialization_timeout=config.get("timeout_seconds", 300))
