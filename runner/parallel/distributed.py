"""Multi-host start-up through JAX's own runtime (`jax.distributed.initialize`), before anything
touches a JAX device: from the config (`distributed.coordinator_address=host:port
distributed.num_processes=n distributed.process_id=i`), the environment JAX recognises (SLURM, TPU
VMs, Kubernetes, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID), or not at all."""
from __future__ import annotations

import os

import jax

_CLUSTER_VARIABLES = ("SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS",
                      "OMPI_COMM_WORLD_SIZE")


def cluster_detected() -> bool:
  """Whether the environment describes a multi-process job that JAX can join by itself."""
  if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
    return False  # a single SLURM task: nothing to coordinate
  return any(os.environ.get(v) for v in _CLUSTER_VARIABLES)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = True,
               timeout_seconds: int = 300) -> None:
  """Joins the multi-process job at `coordinator_address`, or the one the environment describes
  (the config layer has checked that an address comes with the process count and index)."""
  if jax.distributed.is_initialized():
    return
  if coordinator_address:
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_seconds)
  elif auto and cluster_detected():
    jax.distributed.initialize(initialization_timeout=timeout_seconds)
