"""One module per subcommand; each `run(config, placement) -> dict` wires library calls, nothing more.

`run_task` does what every subcommand does first: join the job, check the config against the
devices, and hold the workdir's lock so that no second process writes into a live run.
"""
from __future__ import annotations

import importlib
import sys

import jax


def run_task(name: str, config) -> dict:
  from runner.tasks import common
  from runner.workdir_lock import WorkdirLock
  module = importlib.import_module(f"runner.tasks.{name.replace('-', '_')}")
  placement = common.start(config)
  with WorkdirLock(config.workdir, " ".join(sys.argv), enabled=jax.process_index() == 0):
    return module.run(config, placement)
