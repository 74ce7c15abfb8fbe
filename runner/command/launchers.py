"""What the launchers' and sweepers' keys (`hydra.launcher.*`, `hydra.sweeper.*`) may be.

Hydra's plugins take any value and fail late, in submitit or Optuna, with their tracebacks (or
after the jobs were submitted). The ranges are declared here once, per plugin (recognised by the
`_target_` Hydra composes), and checked with the run's own keys before anything is launched.
"""
from __future__ import annotations

from runner.config.checks import Check, Range, Rule, at_least, positive

_SUBMITIT = {  # hydra-submitit-launcher: SLURM and its local stand-in
    "nodes": at_least(1), "tasks_per_node": at_least(1), "gpus_per_node": at_least(0),
    "cpus_per_task": at_least(1), "mem_gb": positive(), "timeout_min": at_least(1),
}
_SLURM = {**_SUBMITIT, "gpus_per_task": at_least(1), "cpus_per_gpu": at_least(1),
          "signal_delay_s": at_least(0), "max_num_timeout": at_least(0),
          "array_parallelism": at_least(1)}
_DIRECTIONS = ("minimize", "maximize")

# The plugin's class name (the end of `_target_`) -> its keys that have a range.
LAUNCHERS: dict[str, dict[str, Check]] = {
    "SlurmLauncher": _SLURM,
    "LocalLauncher": _SUBMITIT,
    "ParallelLauncher": {"jobs": at_least(1)},
}
SWEEPERS: dict[str, dict[str, Check]] = {
    "BasicSweeper": {"max_batch_size": at_least(1)},
    "OptunaSweeper": {
        "n_trials": at_least(1), "n_jobs": at_least(1), "max_failure_rate": Range(0, 1),
        "direction": Rule(lambda v: (_direction(v) in _DIRECTIONS if not isinstance(v, list)
                                     else bool(v) and all(_direction(d) in _DIRECTIONS
                                                          for d in v)),
                          "minimize or maximize (a list of them for several objectives)"),
    },
}


def _direction(value) -> str:
  return str(getattr(value, "name", value))


def plugin_name(node: dict) -> str:
  """The class a launcher or sweeper config instantiates, e.g. SlurmLauncher."""
  return str(node.get("_target_") or "").rsplit(".", 1)[-1]


def problem(section: str, node: dict) -> str | None:
  """What is wrong with `hydra.<section>` (launcher or sweeper, as a plain dict), or None."""
  table = (LAUNCHERS if section == "launcher" else SWEEPERS).get(plugin_name(node), {})
  for name, check in table.items():
    value = node.get(name)
    if value is not None and (wrong := check(value)):
      others = ", ".join(f"{k} {c.describe() if isinstance(c, Range) else c.valid}"
                         for k, c in table.items() if k != name)
      return (f"hydra.{section}.{name}={value} {wrong}"
              + (f" ({plugin_name(node)}'s other keys with a range: {others})." if others
                 else "."))
  return None
