"""`vmoe <subcommand> [hydra overrides]`: compose the subcommand's config with Hydra, run its task.

Before Hydra runs (and creates the workdir), every job's overrides (each combination of a sweep's
values) are composed and validated against the schema (runner/config): a typo or a bad value is
one paragraph naming what is valid, and nothing is written. Errors that stop a run
(runner/errors.py) print one paragraph and exit with their code; only debug=true shows
tracebacks. The parts are runner/command's, one job per module."""
from __future__ import annotations

import importlib
import os
import sys

import hydra

from runner import builtins, plugins
from runner.command import allocator, arguments, compose, help_page, job, preflight, sweep_table
from runner.config import conf_dir
from runner.errors import UserError
from runner.workdirs import refused_workdir

SUBCOMMANDS = {
    "pretrain": "train a ViT or V-MoE upstream (default: V-MoE tiny on embedded MNIST-5k)",
    "finetune": "fine-tune a checkpoint with a new head (default: embedded UCI digits)",
    "fewshot": "linear few-shot accuracy of frozen features (ridge on pre-logits, 1-25 shots)",
    "eval": "evaluate a checkpoint: accuracy, NLL, calibration, OOD, corruptions, PGD, GFLOPs",
    "ensemble": "evaluate checkpoints as one ensemble (deep, partitioned, MC-dropout): + diversity",
    "compress": "fewer experts per MoE layer, pruned or merged by a calibration set's routing",
    "export": "a checkpoint as safetensors + a plain PyTorch model with the same probabilities",
    "summarize": "one table (Markdown, CSV, plots) of a sweep's jobs: overrides and final metrics",
    "report": "one offline HTML page of a run or a sweep: curves, expert load, metrics, pictures",
}
# Subcommands that are not Hydra stages: plain arguments.
TOOLS = {"summarize": "runner.report.summarize_command", "report": "runner.report.command"}
USAGE = """usage: vmoe <subcommand> [overrides ...] [--multirun] [--cfg job] [--help]

Sparse Vision Mixture-of-Experts experiments in JAX.

subcommands:
{lines}

Overrides are Hydra's: key=value (optim.lr=3e-3), group=option (model=vit_s32, data=cifar10),
comma lists with --multirun (optim.lr=1e-3,3e-3 seed=0,1). `vmoe <subcommand> --help` lists the
config groups and options; `vmoe <subcommand> --cfg job` prints the composed config (with
--multirun, every job's).
Studies: `vmoe finetune -cd sweeps -cn <study>` (see sweeps/README.md). Add debug=true to see
Python tracebacks.
"""


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    lines = "\n".join(f"  {name:<10} {text}" for name, text in SUBCOMMANDS.items())
    print(USAGE.format(lines=lines))
    return 0
  sub, rest = argv[0], argv[1:]
  if sub not in SUBCOMMANDS:
    print(f"vmoe: error: unknown subcommand {sub!r}; valid: {', '.join(SUBCOMMANDS)} "
          "(`vmoe --help` describes each).", file=sys.stderr)
    return 2
  if sub in TOOLS:
    return importlib.import_module(TOOLS[sub]).main(rest)
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


def entry() -> None:
  """The `vmoe` console script."""
  allocator.reexec_with_jemalloc()
  allocator.pause_collector()
  sys.exit(main())


if __name__ == "__main__":
  allocator.pause_collector()
  sys.exit(main())
