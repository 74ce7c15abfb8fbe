"""A job of hydra/launcher=parallel: `python -m hydra_plugins.vmoe_launchers.pinned_job <stage>
[overrides]` is `vmoe <stage> [overrides]` pinned to the CPU cores listed in VMOE_CPUS.

The job pins itself, first thing, while it is still one thread: every thread it starts later
(XLA's, TensorFlow's) inherits the cores. The launcher cannot pin it from outside without a
preexec_fn, which makes subprocess fork the launcher's multi-threaded process (JAX warns that this
may deadlock); without one, the job is spawned.
"""
import os
import sys

CPUS_VARIABLE = "VMOE_CPUS"  # comma-separated core ids, as the launcher's slot gives them


def pin_to_given_cpus() -> None:
  cpus = os.environ.get(CPUS_VARIABLE)
  if cpus:
    os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})


if __name__ == "__main__":
  pin_to_given_cpus()
  from runner import cli  # after pinning: loading it starts no thread, but JAX and TF will
  sys.exit(cli.main())
