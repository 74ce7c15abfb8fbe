"""One module per subcommand, each `run(config, placement, checkpoints) -> dict` wiring library
calls, nothing more. `run_task` does what every subcommand does first: join the job, check the
config against the devices, and hold the workdir's lock (no second process writes into a live
run). Each is a record of runner/config/subcommands.py, which names its module and its main
metric (the number a stage is judged by: what a hyperparameter search maximises)."""
from __future__ import annotations

import importlib
import sys

import jax

from runner.config import subcommands
from runner.stages import setup
from runner.workdirs.workdir_lock import WorkdirLock


def run_task(name: str, config, checkpoints, *, devices_checked: bool = False) -> float:
  """Runs subcommand `name`; returns its main metric (its summary is in the workdir). `checkpoints`
  (runner.checkpoints.weights.Checkpoints) opens the job's checkpoint paths, once each;
  `devices_checked`: the CLI checked the config against this process's devices already."""
  module = importlib.import_module(subcommands.get(name).module)
  placement = setup.start(config, name, check_devices=not devices_checked)
  with WorkdirLock(config.workdir, " ".join(sys.argv), enabled=jax.process_index() == 0):
    summary = module.run(config, placement, checkpoints)
  return subcommands.main_metric(name, summary)
