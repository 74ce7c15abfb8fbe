"""vmoe's own router families, evaluators, optimizers, schedules, model names, embedded datasets,
preprocessing ops and corruptions, and the config checks that open a run's inputs, registered as a plug-in's are: each module registers what it
defines when it is imported (runner/plugins.py). `register()` is the one call that does it for
all of them, before a config is composed (the CLI, a launcher's job, the tests)."""
from __future__ import annotations

_registered = False


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
