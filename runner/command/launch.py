"""Runs a Hydra subcommand of `vmoe` (runner/cli.py hands it over): its plug-ins loaded, every
job's config composed and checked before anything is written, then Hydra's job runner or a
sweep's launcher."""
from __future__ import annotations

import os
import sys

import hydra

from runner import builtins, plugins
from runner.command import allocator, arguments, compose, help_page, job, preflight, sweep_table
from runner.config import conf_dir
from runner.errors import UserError
from runner.workdirs import refused_workdir


def run(sub: str, rest: list[str]) -> int:
  """`vmoe <sub> <rest>`, a subcommand Hydra composes: its exit code."""
  allocator.quiet_environment()
  try:  # before the schemas reach Hydra: a plug-in adds names and keys to them
    plugins.load(plugins.requested(arguments.split_args(rest)[1]))
    from runner.checkpoints import weights  # lazily, as runner/command does: `vmoe --help` stays fast
    checkpoints = weights.Checkpoints()  # the checks open each checkpoint path once
    rest = preflight.with_recorded_plugins(sub, rest, checkpoints)
  except UserError as e:
    print(f"vmoe {sub}: error: {e}", file=sys.stderr)
    return 2
  builtins.register()
  os.environ[builtins.PLUGINS_VARIABLE] = ",".join(plugins.loaded())  # a job process loads them
  from runner.command import config_store  # lazily, as weights above
  config_store.register_configs()  # the schemas, made once now that everything has registered
  if not any(arg.lstrip("+").lower() in ("debug=true", "debug=1") for arg in rest):
    job.quiet_library_noise()
  checked = preflight.check(sub, rest, checkpoints)
  if checked.problem:
    print(f"vmoe {sub}: error: {checked.problem}", file=sys.stderr)
    return 2
  os.environ["VMOE_STAGE"] = sub  # what hydra/launcher=parallel starts in each job
  modes = arguments.modes(rest)
  if len(modes) > 1 and modes != {"--multirun", "--cfg"}:
    print(f"vmoe {sub}: error: {' and '.join(sorted(modes))} each choose what the command does "
          "(run a sweep, show the config, show Hydra's information, shell completion); give one "
          "of them (--multirun with --cfg job shows every job's config).", file=sys.stderr)
    return 2
  if modes == {"--multirun", "--cfg"}:
    return compose.show_sweep(sub, rest)
  if any(a.replace(" ", "") == "hydra/sweeper=optuna" for a in rest) and not any(
      a.startswith("hydra.sweeper.direction") for a in rest):
    rest = rest + ["hydra.sweeper.direction=maximize"]  # each stage returns its main metric
  sys.argv = [f"vmoe {sub}"] + arguments.overrides_first(rest)
  flags, overrides, shows = arguments.split_args(rest)
  shows_help = any(a in ("-h", "--help") for a in rest)
  if shows_help and not modes and not (flags.keys() & {"-cd", "--config-dir"}):
    return help_page.main(sub, flags.get("-cn") or flags.get("--config-name") or sub, overrides,
                          resolve="--resolve" in rest)
  shows_only = modes or shows  # no job runs: nothing to clean up after
  # The deepest folder of the workdir's path that exists before Hydra creates the workdir.
  existed = None if shows_only else refused_workdir.nearest_existing(checked.workdir)
  task = job.Job(sub, existed, checked.devices_checked)
  try:
    if checked.composition is not None and not shows_only:
      compose.run_composed(checked.composition, task)  # a plain run: composed once, above
    else:
      hydra.main(config_path=str(conf_dir()), config_name=sub, version_base=None)(task)()
  finally:  # Hydra exits as soon as it has printed its help, or a sweep's job has failed
    sweep_table.print_stopped_sweep()  # a sweep that a failed job stopped: its table all the same
    if shows_help:
      print(job.registered_names())
  return 0
