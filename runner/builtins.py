"""vmoe's own router families, evaluators, optimizers, schedules, model names, embedded datasets,
preprocessing ops and corruptions, and the config checks that open a run's inputs, registered as a plug-in's are: each module registers what it
defines when it is imported (runner/plugins.py). `register()` is the one call that does it for
all of them, before a config is composed (the CLI, a launcher's job, the tests)."""
from __future__ import annotations

import os

from runner import plugins
from runner.config import sections

_registered = False
# The plug-ins the command loaded, for a job started in a process of its own (runner/cli.py).
PLUGINS_VARIABLE = "VMOE_PLUGINS"


def register() -> None:
  """Imports the modules that register the built-ins, once per process (lazily: `vmoe --help`
  stays fast)."""
  global _registered
  if _registered:
    return
  import runner.checkpoints.checks  # noqa: F401  (relations that read checkpoints)
  import runner.data  # noqa: F401  (embedded datasets, preprocessing ops, corruptions)
  import runner.evaluators  # noqa: F401
  import runner.export.files  # noqa: F401  (the export folder's relation)
  import runner.models  # noqa: F401  (router families, model names)
  import runner.train.optimizers  # noqa: F401
  import runner.train.schedules  # noqa: F401
  _registered = True


class _Schema(sections.Finder):
  """Where pickle finds the schema's built classes. A launcher's job process (SLURM's, the
  `parallel` launcher's) may unpickle a composed config before the job that registers: the first
  lookup registers the built-ins and loads the plug-ins the submitting command had loaded, then
  builds the schema with all their keys."""

  def __getattr__(self, name: str) -> type:
    register()
    plugins.load([m for m in os.environ.get(PLUGINS_VARIABLE, "").split(",") if m])
    return super().__getattr__(name)


SCHEMA = _Schema()
sections.pickled_as(__name__, "SCHEMA")
