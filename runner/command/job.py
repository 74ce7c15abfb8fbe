"""Running a stage as Hydra's task function: its config typed, its task run, its page written,
and an error ending the process with one paragraph and its exit code (runner/errors.py); a job
refused for bad input leaves no workdir behind (runner/workdirs/refused_workdir.py)."""
from __future__ import annotations

import json
import logging
import os
import pathlib
import sys

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from runner import builtins, config as config_layer, plugins
from runner.command import allocator
from runner.config import registries, subcommands
from runner.errors import UserError, VmoeError
from runner.workdirs import refused_workdir


def quiet_library_noise() -> None:
  """Drops what Orbax/TensorStore print about a failed read besides our one-paragraph message
  (debug=true keeps it): absl ERROR lines; after the error has reached us, "Event loop is closed"
  tracebacks, one "Exception ignored" traceback per abandoned concurrent array read (dozens for a
  damaged checkpoint), and asyncio's "exception was never retrieved" for each abandoned read's
  future once collected (after a refused run's workdir is gone). vmoe itself uses no asyncio."""
  logging.getLogger("absl").setLevel(logging.CRITICAL)
  logging.getLogger("asyncio").setLevel(logging.CRITICAL)
  default = sys.unraisablehook
  if getattr(default, "vmoe_quiet", False):
    return  # installed by an earlier command in this process (the demo, tests)

  def hook(unraisable):
    error = unraisable.exc_value
    closed = isinstance(error, RuntimeError) and "Event loop is closed" in str(error)
    if not (closed or _abandoned_checkpoint_read(unraisable.object)):
      default(unraisable)
  hook.vmoe_quiet = True
  sys.unraisablehook = hook


def _abandoned_checkpoint_read(obj) -> bool:
  """An unfinished Orbax coroutine: a read abandoned as another of the same checkpoint failed."""
  code = getattr(obj, "cr_code", None)
  return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


# hydra/launcher=parallel starts each job as a `vmoe` process of its own, a plain run to Hydra;
# this variable tells the job its sweep: {"sweep_dir": ..., "overrides": [the job's overrides]}.
SWEEP_JOB_VARIABLE = "VMOE_SWEEP_JOB"


def _sweep_identity(typed) -> None:
  """A sweep's job: its W&B run joins the sweep's group (logger.wandb.group, else the sweep's
  folder) and records the overrides that make the job, whichever launcher started it."""
  hydra = HydraConfig.get()
  if hydra.mode == RunMode.MULTIRUN:  # the basic launcher, or SLURM's (Hydra's run_job there)
    sweep_dir, overrides = str(hydra.sweep.dir), list(hydra.overrides.task)
  elif os.environ.get(SWEEP_JOB_VARIABLE):
    job = json.loads(os.environ[SWEEP_JOB_VARIABLE])
    sweep_dir, overrides = job["sweep_dir"], job["overrides"]
  else:
    return
  wandb = typed.logger.wandb
  wandb.group = wandb.group or sweep_dir
  wandb.overrides = overrides


class Job:
  """The Hydra task function of stage `sub`. `existed`: the deepest folder of the workdir's path
  that existed before Hydra created it (what a refused run removes stops there); `devices_checked`:
  the pre-flight checks already validated the config against this process's devices.

  A launcher that runs the job in a process of its own (SLURM's, through submitit) pickles it
  with the composed config and Hydra's store. Unpickled there, it registers the built-ins and
  loads the plug-ins this process loaded before the launcher composes the job's config there:
  that composition is the schema's first use, which makes it once (runner/config/sections.py)."""

  def __init__(self, sub: str, existed: pathlib.Path | None = None, devices_checked: bool = False):
    self.sub, self.existed, self.devices_checked = sub, existed, devices_checked

  def __reduce__(self):
    return (_unpickled_job, (self.sub, self.existed, self.devices_checked, plugins.loaded()))

  def __call__(self, cfg):
    from runner.checkpoints import weights
    from runner.tasks import run_task
    sub = self.sub
    hydra_config = HydraConfig.get()
    workdir = hydra_config.runtime.output_dir
    new_workdir = (hydra_config.mode == RunMode.RUN
                   and refused_workdir.is_new(workdir, hydra_config.job.name))
    try:
      # The built-ins registered when it was unpickled, or by the CLI in this process; the
      # config's plug-ins again, in case a launcher composed it with others.
      plugins.load(cfg.get("plugins") or [])
      # Checked before launch, and in the job once more with its devices (stages/setup.py).
      checkpoints = weights.Checkpoints()  # the job opens each checkpoint path once
      typed = config_layer.load(sub, cfg, workdir, check=False, checkpoints=checkpoints)
      _sweep_identity(typed)
      allocator.resume_collector()  # the libraries have loaded
      metric = run_task(sub, typed, checkpoints, devices_checked=self.devices_checked)
      # An export's folder is a model folder (its README.md is the card): no report page.
      if typed.logger.report and subcommands.get(sub).has_run_page:
        _write_report(typed.workdir)
      return metric
    except VmoeError as e:
      if isinstance(e, UserError) and new_workdir:
        refused_workdir.remove(workdir, self.existed)  # nothing a later run could take for one
      if cfg.get("debug"):
        raise
      print(f"vmoe {sub}: error: {e}", file=sys.stderr)
      sys.exit(e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before the training loop took over the signal
      if cfg.get("debug"):
        raise
      print(f"vmoe {sub}: interrupted before training started; nothing was saved.", file=sys.stderr)
      sys.exit(130)


def _unpickled_job(sub: str, existed, devices_checked: bool, plugin_names: list[str]) -> Job:
  """A job arriving in a process of its own: what registers keys registers before any config."""
  builtins.register()
  plugins.load(plugin_names)
  return Job(sub, existed, devices_checked)


def _write_report(workdir: str) -> None:
  """The run's `vmoe report` page, refreshed as the stage ends (one writer per job)."""
  import jax  # lazily, as every library module here; the task has started it already
  if jax.process_index():
    return
  from runner import report  # lazily: matplotlib, only once a stage has run
  run = None  # the workdir, read once for the page and for W&B
  try:
    run = report.read_run(workdir)
    report.write_run_page(workdir, live=False, run=run)
  except Exception as e:  # noqa: BLE001 (the stage's results are written: a page is extra)
    print(f"vmoe: warning: the run's report.html was not written ({type(e).__name__}: {e}); "
          f"`vmoe report {workdir}` tries again.", file=sys.stderr)
  try:
    report.publish_to_wandb(workdir, run=run)  # the page's heat maps and tables, when W&B is on
  except Exception as e:  # noqa: BLE001 (as the page: extra, never the stage's failure)
    print(f"vmoe: warning: the run's heat maps and tables did not reach W&B "
          f"({type(e).__name__}: {e}).", file=sys.stderr)


def registered_names() -> str:
  """What `--help` adds to Hydra's: every name a config may choose, built-in or a plug-in's."""
  from runner.data import pp_ops, sources
  from runner.models import catalog
  lines = ["", "== Registered names (built-in and from plugins=[...]) =="]
  for what, names in (("model.router.type", registries.ROUTERS.names()),
                      ("evaluators (eval.*)", registries.EVALUATORS.names()),
                      ("optim.name", registries.OPTIMIZERS.names()),
                      ("schedule.name", registries.SCHEDULES.names()),
                      ("data.name (embedded, image_folder, captions)", sources.known_names()),
                      ("preprocessing ops", pp_ops.registered_ops()),
                      ("model= (besides the name grammar)", catalog.registered_names())):
    lines.append(f"{what}: {', '.join(names) or '-'}")
  return "\n".join(lines)
