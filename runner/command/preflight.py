"""What is checked before anything runs or is submitted: every job of a sweep composed and
validated (against this process's devices when it runs the job itself), the launcher able to
submit, the plug-ins a starting checkpoint's run recorded loaded, and where the workdir's path
begins to be new (what a refused run removes stops there)."""
from __future__ import annotations

import dataclasses
import re
import sys

from hydra.types import RunMode

from runner import config as config_layer, plugins
from runner.command import arguments, compose, launchers
from runner.errors import UserError


@dataclasses.dataclass(frozen=True)
class Preflight:
  """What the checks found: the error paragraph (None: none); whether every job was checked against
  this process's devices too (the job, run here by the basic launcher, skips them); `workdir`:
  the run's workdir composed without sweep values (None when nothing was); `composition`: a run's
  config and `hydra` node for compose.run_composed (None for a sweep: Hydra composes its jobs)."""
  problem: str | None = None
  devices_checked: bool = False
  workdir: str | None = None
  composition: compose.Composition | None = None


def _devices_here(composed, launcher: str) -> int | None:
  """The device count when this process is the job itself (the basic launcher, one process); None
  where the job runs elsewhere (SLURM, the parallel launcher, other hosts), checking them there."""
  from runner.parallel.distributed import cluster_detected  # lazily, as the library's modules
  if launcher != "basic" or composed.get("distributed", {}).get("coordinator_address") \
      or cluster_detected():
    return None
  import jax  # lazily: JAX starts its backend here, in the process that runs the job
  return jax.device_count()


def check(sub: str, args: list[str], checkpoints=None) -> Preflight:
  """Whether the overrides (every job of a sweep) compose and validate, and the launcher can start
  the jobs from here. `checkpoints` (a new weights.Checkpoints by default) opens the paths named."""
  if checkpoints is None:
    from runner.checkpoints import weights  # lazily, as every library module here (runner/command)
    checkpoints = weights.Checkpoints()
  flags, overrides, show = arguments.split_args(args)
  compose.register_requested_models(overrides)
  if show:
    return Preflight()
  config_dir = flags.get("-cd") or flags.get("--config-dir")
  config_name = flags.get("-cn") or flags.get("--config-name") or sub
  # `--cfg job` shows the composed config: keys and types are checked by composing, but nothing
  # is read (an eval's checkpoint need not exist yet) and no value is validated.
  compose_only = bool(flags.get("--cfg") or flags.get("-c"))
  try:
    choices = compose.hydra_choices(config_dir, config_name, overrides)
    jobs = arguments.jobs(overrides, compose.study_params(choices))
  except Exception as err:  # Hydra/OmegaConf raise many types; all mean "bad input"
    return Preflight(compose.explain_composition_error(err, sub, overrides, config_dir,
                                                       config_name))
  for section, node in choices["plugins"].items():
    if problem := launchers.problem(section, node):
      return Preflight(problem)
  checked_here = len(jobs) == arguments.job_count(overrides, compose.study_params(choices))
  for job in jobs:
    try:  # a run without a sweep was composed above already
      composed = (choices["composed"] if job == choices["job"]
                  else compose.compose(config_dir, config_name, job))
    except Exception as err:
      return Preflight(compose.explain_composition_error(err, sub, job, config_dir, config_name))
    if compose_only:
      continue
    try:
      # Once, before anything is launched or submitted; what needs the devices too when this
      # process runs the job, else the job checks that when it starts (runner/stages/setup.py).
      typed = config_layer.load(sub, composed, check=False, checkpoints=checkpoints)
      devices = _devices_here(composed, choices["launcher"])
      config_layer.validate(typed, devices=devices, checkpoints=checkpoints)
      checked_here = checked_here and devices is not None
    except UserError as err:
      swept = [o for o in job if o not in overrides]
      return Preflight((f"in the sweep job {' '.join(swept)}: " if swept else "") + str(err))
  sweeps = arguments.multirun(args) or choices["mode"] == RunMode.MULTIRUN
  problem = (_submission_problem(choices["plugins"]["launcher"])
             if not compose_only and arguments.multirun(args) else None)
  return Preflight(problem, devices_checked=checked_here and not compose_only and not problem,
                   workdir=str(choices["composed"].workdir),
                   composition=None if sweeps else choices["composition"])


def _submission_problem(launcher: dict) -> str | None:
  """Whether the launcher can start the jobs from here: SLURM reachable, the partition known."""
  if launchers.plugin_name(launcher) != "SlurmLauncher":
    return None
  from runner.parallel import slurm  # lazily, as every library module here
  if problem := slurm.submission_problem(launcher.get("partition")):
    return (f"hydra/launcher=slurm submits the sweep's jobs with sbatch, but {problem}. Run the "
            "command where SLURM is reachable (a cluster's login node), or run the jobs on this "
            "machine: hydra/launcher=parallel (several at a time) or no launcher (one after "
            "another). docs/cluster.md shows both.")
  return None


def with_recorded_plugins(sub: str, args: list[str], checkpoints) -> list[str]:
  """A stage started from runs trained with plug-ins loads them too (said in one line) and records
  them as its own `plugins=` (so a job in a process of its own, and the next stage, load them):
  those checkpoints need their router families, models and evaluators. `checkpoints` opens paths."""
  overrides = arguments.split_args(args)[1]
  given = plugins.requested(overrides)
  recorded = {}  # module -> the first run that recorded it
  for path in _init_checkpoints(overrides):
    try:
      stored = checkpoints.stored_config(path) or {}
    except UserError:
      continue  # the checkpoint's own check says what is wrong with it
    for name in stored.get("plugins") or []:
      if str(name) not in given:
        recorded.setdefault(str(name), path)
  if not recorded:
    return args
  runs = ", ".join(sorted(set(recorded.values())))
  try:
    plugins.load(list(recorded))
  except plugins.PluginError as e:
    raise plugins.PluginError(
        f"init.checkpoint={runs} was trained with plugins=[{','.join(recorded)}], which vmoe "
        f"{sub} loads to read it, and they cannot be loaded here: {e}") from None
  print(f"vmoe {sub}: loading the plug-ins {runs} was trained with: "
        f"plugins=[{','.join(recorded)}]", file=sys.stderr)
  given_as = [a for a in args if a.partition("=")[0].lstrip("+~") == "plugins"]
  if any("],[" in a.replace(" ", "") for a in given_as):
    return args  # a sweep over plug-in lists: each job's list stands as given
  names = ",".join(given + list(recorded))
  return [a for a in args if a not in given_as] + [f"plugins=[{names}]"]


def _init_checkpoints(overrides: list[str]) -> list[str]:
  """The paths `init.checkpoint=` names: one, or a list (ensemble, few-shot)."""
  for override in overrides:
    key, eq, value = override.partition("=")
    if eq and key.lstrip("+~") == "init.checkpoint":
      items = re.split(r"[,\[\]]+", value)
      return [item.strip().strip("'\"") for item in items if item.strip() not in ("", "null")]
  return []
