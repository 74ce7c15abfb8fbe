"""One module per subcommand; each `run(cfg, workdir) -> dict` wires library calls, nothing more."""
from __future__ import annotations

import importlib


def run_task(name: str, cfg, workdir: str) -> dict:
  module = importlib.import_module(f"runner.tasks.{name.replace('-', '_')}")
  return module.run(cfg, workdir)
