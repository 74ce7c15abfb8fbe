"""vmoe's own router families, evaluators, optimizers, schedules, model names, embedded datasets,
preprocessing ops, corruptions and the config checks that open a run's inputs, registered as a
plug-in's are: each module registers what it defines when imported (runner/plugins.py). The one
call `register()` does it for them all, before a config is composed (CLI, launcher job, tests)."""
from __future__ import annotations

import functools
import os

from runner import plugins
from runner.config import sections

PLUGINS_VARIABLE = "VMOE_PLUGINS"  # the command's plug-ins, for a job's own process (runner/cli.py)


@functools.cache
def register() -> None:
  """Imports the built-ins' modules, once per process (lazily, so that `vmoe --help` stays fast)."""
  import runner.checkpoints.checks  # noqa: F401  (relations that read checkpoints)
  import runner.data  # noqa: F401  (embedded datasets, preprocessing ops, corruptions)
  import runner.evaluators  # noqa: F401
  import runner.export.files  # noqa: F401  (the export folder's relation)
  import runner.models  # noqa: F401  (router families, model names)
  import runner.train.optimizers  # noqa: F401
  import runner.train.schedules  # noqa: F401


class _Schema(sections.Finder):
  """Where pickle finds the schema's built classes. A launcher's job process may unpickle a config
  before the job registers: the first lookup registers the built-ins and the command's plug-ins."""

  def __getattr__(self, name: str) -> type:
    _prepare_job_process()
    return super().__getattr__(name)


@functools.cache
def _prepare_job_process() -> None:
  """Once: pickle looks a class up for every config it reads or writes."""
  register()
  plugins.load([m for m in os.environ.get(PLUGINS_VARIABLE, "").split(",") if m])


SCHEMA = _Schema()
sections.pickled_as(__name__, "SCHEMA")
