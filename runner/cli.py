"""`vmoe <subcommand> [hydra overrides]`: compose the subcommand's config with Hydra, run its task.

Before Hydra runs (and creates the workdir), the overrides are composed here and the result is
validated against the schema (runner/config), for every combination of a sweep's values, so a
typo or a bad value is reported as one paragraph naming what is valid, and nothing is written.
Errors that stop a run (runner/errors.py) print one paragraph and exit with their code; only
debug=true shows tracebacks.
"""
from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import pathlib
import re
import sys

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from hydra_plugins.vmoe_launchers import sweep_table
from runner import config as config_layer, plugins, refused_workdir
from runner.config import conf_dir, launchers, registries
from runner.errors import UserError, VmoeError

# The library's own modules (models, data, training, evaluators, tasks: JAX and TensorFlow) are
# imported inside the functions that need them, deliberately: a command first re-executes itself
# with jemalloc and quiets TensorFlow's environment (entry(), _quiet_environment()), which must
# happen before those libraries load, and `vmoe --help` or `vmoe summarize` need none of them.

SUBCOMMANDS = {
    "pretrain": "train a ViT or V-MoE upstream (default: V-MoE tiny on embedded MNIST-5k)",
    "finetune": "fine-tune a checkpoint with a new head (default: embedded UCI digits)",
    "fewshot": "linear few-shot accuracy of frozen features (ridge on pre-logits, 1-25 shots)",
    "eval": "evaluate a checkpoint: accuracy, NLL, calibration, OOD, corruptions, PGD, GFLOPs",
    "ensemble": "evaluate checkpoints as one ensemble (deep, partitioned, MC-dropout): + diversity",
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
# Hydra flags that take a value, and flags that mean "don't run, just show something".
_VALUE_FLAGS = {"-cd", "--config-dir", "-cn", "--config-name", "-cp", "--config-path", "-c",
                "--cfg", "-p", "--package", "--experimental-rerun", "--info"}
_SHOW_FLAGS = {"-h", "--help", "--hydra-help", "--version", "-i", "--info", "--shell-completion",
               "-sc"}


# XLA on CPU allocates each step's temporaries (hundreds of MB) afresh; glibc maps and unmaps such
# blocks every step, so the step spends a third of its time in page faults. jemalloc keeps them
# mapped: a ViT/V-MoE train step runs 1.4-1.6x faster. See docs/speed.md.
JEMALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:60000,muzzy_decay_ms:60000"
_JEMALLOC_PATHS = ("{prefix}/lib/libjemalloc.so.2", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
                   "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2",
                   "/usr/lib/libjemalloc.so.2")


def find_jemalloc() -> str | None:
  for pattern in _JEMALLOC_PATHS:
    path = pattern.format(prefix=sys.prefix)
    if os.path.exists(path):
      return path
  return None


def _reexec_with_jemalloc() -> None:
  """Restarts this command once with jemalloc preloaded, when it is available (Linux only)."""
  if (os.environ.get("VMOE_ALLOCATOR", "jemalloc") != "jemalloc"
      or "jemalloc" in os.environ.get("LD_PRELOAD", "") or not sys.platform.startswith("linux")):
    return
  library = find_jemalloc()
  if library is None:
    return
  env = dict(os.environ, VMOE_ALLOCATOR="jemalloc",
             LD_PRELOAD=":".join(filter(None, [library, os.environ.get("LD_PRELOAD")])),
             MALLOC_CONF=os.environ.get("MALLOC_CONF", JEMALLOC_CONF))
  os.execve(sys.executable, [sys.executable, "-m", "runner.cli", *sys.argv[1:]], env)


def _quiet_environment() -> None:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  os.environ.setdefault("WANDB_SILENT", "true")
  # Reuse XLA compilations across runs (a rerun, a resume, the next stage with the same model).
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        os.path.join(os.path.expanduser("~"), ".cache", "vmoe", "xla"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def _split_args(args: list[str]) -> tuple[dict, list[str], bool]:
  """(flags with values, overrides, whether Hydra only shows help/info)."""
  flags, overrides, show = {}, [], False
  i = 0
  while i < len(args):
    arg = args[i]
    name, eq, value = arg.partition("=")
    if arg in _SHOW_FLAGS or name in _SHOW_FLAGS:
      show = True
    if name in _VALUE_FLAGS and name.startswith("-"):
      if not eq and i + 1 < len(args):
        value, i = args[i + 1], i + 1
      flags[name] = value
    elif not arg.startswith("-"):
      overrides.append(arg)
    i += 1
  return flags, overrides, show


# Options of hydra/launcher and hydra/sweeper that plugins of the cluster extra provide.
_PLUGIN_CONFIGS = {"submitit_slurm": "hydra-submitit-launcher",
                   "submitit_local": "hydra-submitit-launcher",
                   "optuna": "hydra-optuna-sweeper"}

# Validating each job of a sweep before any runs costs one composition each; beyond this many
# jobs, a covering set of jobs is checked up front, which holds every value of each swept key at
# least once (every job is checked anyway when it starts).
MAX_CHECKED_JOBS = 64
MAX_SHOWN_JOBS = 64  # `--multirun --cfg job` prints this many jobs' configs at most


def _sweep_axes(overrides: list[str], study: dict) -> tuple[list[str], list[list[str]]]:
  """(fixed overrides, one list of `key=value` per swept key), hydra.* dropped.

  `study` holds a sweep study's own `hydra.sweeper.params`; the command line wins over it.
  """
  parser = OverridesParser.create()
  fixed, axes, given = [], [], set()
  for ov in parser.parse_overrides(overrides):
    if ov.key_or_group.startswith("hydra"):
      continue
    given.add(ov.key_or_group)
    if ov.is_sweep_override():
      axes.append([f"{ov.get_key_element()}={v}" for v in _sweep_values(ov)])
    else:
      fixed.append(ov.input_line)
  for key, values in study.items():
    if key not in given:
      ov = parser.parse_overrides([f"{key}={values}"])[0]
      axes.append([f"{key}={v}" for v in ov.sweep_string_iterator()]
                  if ov.is_sweep_override() else [ov.input_line])
  return fixed, axes


class SearchRangeError(ValueError):
  pass


def _sweep_values(override) -> list:
  """The values a sweep override takes; a search range (`interval(a,b)`, for the optuna
  sweeper) is checked to be non-empty and is validated at both of its ends."""
  sweep = override.value()
  if isinstance(sweep, IntervalSweep):
    if not sweep.start < sweep.end:
      raise SearchRangeError(
          f"the search range {override.input_line} is empty: interval(a, b) needs a < b (e.g. "
          f"'{override.get_key_element()}=tag(log,interval(1e-4,1e-1))').")
    return [sweep.start, sweep.end]
  return list(override.sweep_string_iterator())


def _job_count(overrides: list[str], study: dict) -> int:
  count = 1
  for axis in _sweep_axes(overrides, study)[1]:
    count *= len(axis)
  return count


def _jobs(overrides: list[str], study: dict) -> list[list[str]]:
  """The overrides of the jobs to check before the sweep runs: every job (just one without a
  sweep), or beyond MAX_CHECKED_JOBS, jobs of the sweep that take every value of each swept key:
  job i takes value i mod n of each key of n values (as many jobs as the longest key has values)."""
  fixed, axes = _sweep_axes(overrides, study)
  jobs = itertools.islice(itertools.product(*axes), MAX_CHECKED_JOBS + 1)
  combos = [fixed + list(c) for c in jobs]
  if len(combos) <= MAX_CHECKED_JOBS:
    return combos
  return [fixed + [axis[i % len(axis)] for axis in axes]
          for i in range(max(len(axis) for axis in axes))]


def _register_requested_models(overrides: list[str]) -> None:
  """model=<name> in the catalog grammar (vmoe_b16_every2_e32_k2) becomes a `model` option."""
  from runner.config_store import register_model
  from runner.models import catalog
  for ov in overrides:
    key, _, value = ov.partition("=")
    if key.lstrip("+~") == "model":
      for name in value.split(","):
        try:
          register_model(name.strip())
        except catalog.UnknownModelError:
          pass  # Hydra / the check below reports it with the list of valid names


def _explain_composition_error(err: Exception, sub: str, overrides: list[str],
                               config_dir: str | None, config_name: str) -> str:
  """One paragraph for a failed composition: what was wrong and what is valid."""
  from runner.models import catalog
  cause = err.__cause__ or err
  if isinstance(err, SearchRangeError):
    return str(err)
  missing = re.search(r"Could not (?:find|load) '([^']+)'", str(err))
  if missing and missing[1].rsplit("/", 1)[-1] in _PLUGIN_CONFIGS:
    plugin = _PLUGIN_CONFIGS[missing[1].rsplit("/", 1)[-1]]
    return (f"{missing[1]} comes from the {plugin} plugin, which is not installed: install the "
            "cluster extra, pip install -e '.[cluster]' (make test installs it).")
  if type(err).__name__ == "OverrideParseException":
    return (f"cannot parse the overrides {overrides}: {str(err).splitlines()[0]}. Values with "
            "parentheses, commas, spaces or '|' must be quoted for Hydra, e.g. "
            "'data.pp=\"decode(3)|resize(32)|value_range(-1,1)\"' (single quotes for the shell).")
  full_key = getattr(cause, "full_key", None)
  text = str(err).split("\n")[0]
  if "Could not find" in str(err):  # unknown option of a group
    lines = str(err).split("\n")
    group = text.split("'")[-2].rsplit("/", 1)[0] if "'" in text else "?"
    options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
    if group == "model":
      bad = text.split("'")[-2].split("/", 1)[-1]
      try:
        catalog.model_config(bad)
      except catalog.UnknownModelError as e:
        return str(e)
    return (f"{text.split(': ', 1)[-1]}. Valid options for {group}=: {', '.join(options)}.")
  if full_key:
    parent, _, leaf = full_key.rpartition(".")
    valid = ""
    try:
      base = _compose(config_dir, config_name, [])
      node = OmegaConf.select(base, parent) if parent else base
      if node is not None and OmegaConf.is_dict(node):
        valid = f" Valid keys under {parent or 'the top level'}: {', '.join(node.keys())}."
    except Exception:  # the base config itself is broken: say what we know
      pass
    if type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError"):
      return f"unknown config key {full_key!r}.{valid} Run `vmoe {sub} --cfg job` to see every key."
    reason = str(cause).split("\n")[0]
    return f"bad value for {full_key}: {reason}."
  return f"cannot compose the {sub} config from {overrides}: {' '.join(str(err).split())}"


def _compose(config_dir: str | None, config_name: str, overrides: list[str],
             with_hydra: bool = False):
  primary, extra = str(conf_dir()), []
  if config_dir:  # as Hydra's --config-dir: that folder first, conf/ still searched
    primary = os.path.abspath(config_dir)
    extra = [f"hydra.searchpath=[file://{conf_dir()}]"]
  with initialize_config_dir(config_dir=primary, version_base=None):
    return compose(config_name, overrides=extra + overrides, return_hydra_config=with_hydra)


def _study_params(choices: dict) -> dict:
  """A sweep study's `hydra.sweeper.params` (empty for the primary configs)."""
  params = choices["params"]
  return dict(OmegaConf.to_container(params)) if params else {}


def _devices_here(composed, launcher: str) -> int | None:
  """The device count when this process is the job itself (the basic launcher, not part of a
  multi-process job); None where the job runs elsewhere (SLURM, the parallel launcher, other
  hosts), which checks its devices when it starts."""
  from runner.parallel.distributed import cluster_detected  # lazily, as the library's modules
  if launcher != "basic" or composed.get("distributed", {}).get("coordinator_address") \
      or cluster_detected():
    return None
  import jax  # lazily: JAX starts its backend here, in the process that runs the job
  return jax.device_count()


# Whether check_overrides checked every job of this process's command against its devices too
# (then the job, run here by the basic launcher, does not check them again).
_devices_checked = False


def _hydra_choices(config_dir: str | None, config_name: str, overrides: list[str]) -> dict:
  """The sweep's Hydra config composed with the hydra.* overrides (a launcher's or sweeper's
  option of the wrong type fails here): the launcher and sweeper chosen, and a study's
  `hydra.sweeper.params`."""
  first = _sweep_axes(overrides, {})[0]
  hydra_given = [o for o in overrides if o.lstrip("+~").startswith("hydra")]
  composed = _compose(config_dir, config_name, first + hydra_given, with_hydra=True)
  node = composed.hydra
  with open_dict(composed):
    del composed["hydra"]
  return {"launcher": node.runtime.choices.get("hydra/launcher", "basic"),
          "sweeper": node.runtime.choices.get("hydra/sweeper", "basic"),
          "params": node.sweeper.get("params"),
          "plugins": {section: OmegaConf.to_container(node[section], resolve=False,
                                                      enum_to_str=True)
                      for section in ("launcher", "sweeper")},
          "job": first, "composed": composed}  # the job without sweep values, composed


def check_overrides(sub: str, args: list[str]) -> str | None:
  """The error paragraph if the overrides (every job of a sweep) do not compose and validate."""
  from runner import weights  # lazily, as every library module here (see the imports above)
  global _devices_checked
  _devices_checked = False
  flags, overrides, show = _split_args(args)
  _register_requested_models(overrides)
  if show:
    return None
  config_dir = flags.get("-cd") or flags.get("--config-dir")
  config_name = flags.get("-cn") or flags.get("--config-name") or sub
  # `--cfg job` shows the composed config: keys and types are checked by composing, but nothing
  # is read (an eval's checkpoint need not exist yet) and no value is validated.
  compose_only = bool(flags.get("--cfg") or flags.get("-c"))
  try:
    choices = _hydra_choices(config_dir, config_name, overrides)
    jobs = _jobs(overrides, _study_params(choices))
  except Exception as err:  # Hydra/OmegaConf raise many types; all mean "bad input"
    return _explain_composition_error(err, sub, overrides, config_dir, config_name)
  for section, node in choices["plugins"].items():
    problem = launchers.problem(section, node)
    if problem:
      return problem
  checked_here = len(jobs) == _job_count(overrides, _study_params(choices))
  for job in jobs:
    try:  # a run without a sweep was composed above already
      composed = (choices["composed"] if job == choices["job"]
                  else _compose(config_dir, config_name, job))
    except Exception as err:
      return _explain_composition_error(err, sub, job, config_dir, config_name)
    if compose_only:
      continue
    try:
      # Once, before anything is launched or submitted; what needs the devices too when this
      # process runs the job, else the job checks that when it starts (runner/tasks/common.py).
      typed = config_layer.load(sub, composed, check=False, checkpoints=weights)
      devices = _devices_here(composed, choices["launcher"])
      config_layer.validate(typed, devices=devices, checkpoints=weights)
      checked_here = checked_here and devices is not None
    except UserError as err:
      swept = [o for o in job if o not in overrides]
      return (f"in the sweep job {' '.join(swept)}: " if swept else "") + str(err)
  _devices_checked = checked_here and not compose_only
  if not compose_only and _multirun(args):
    return _submission_problem(choices["plugins"]["launcher"])
  return None


def _overrides_first(args: list[str]) -> list[str]:
  """The arguments with every override before the first flag: Hydra's argument parser takes
  overrides only before its flags (`seed=1 --multirun`, not `--multirun seed=1 --cfg job x=1`)."""
  flags, overrides, i = [], [], 0
  while i < len(args):
    arg = args[i]
    if arg.startswith("-"):
      flags.append(arg)
      if arg in _VALUE_FLAGS and i + 1 < len(args) and not (
          arg in ("--info", "-i") and "=" in args[i + 1]):  # --info takes an optional value
        flags.append(args[i + 1])
        i += 1
    else:
      overrides.append(arg)
    i += 1
  return overrides + flags


def _show_sweep(sub: str, args: list[str]) -> int:
  """`--multirun ... --cfg job`: each job's composed config, as `--cfg job` shows one run's
  (Hydra itself refuses the pair), with the job's own folder as its workdir. A search
  (hydra/sweeper=optuna) shows its fixed config and the ranges searched."""
  flags, overrides, _ = _split_args(args)
  what = flags.get("--cfg") or flags.get("-c")
  if what != "job":
    print(f"vmoe {sub}: error: --cfg {what} with --multirun: Hydra shows the {what} config of "
          "one run only. Drop --multirun to see it, or use --cfg job to see every job of the "
          "sweep.", file=sys.stderr)
    return 2
  config_dir = flags.get("-cd") or flags.get("--config-dir")
  config_name = flags.get("-cn") or flags.get("--config-name") or sub
  choices = _hydra_choices(config_dir, config_name, overrides)
  study = _study_params(choices)
  fixed, axes = _sweep_axes(overrides, study)
  if launchers.plugin_name(choices["plugins"]["sweeper"]) != "BasicSweeper":
    searched = [ov.input_line for ov in OverridesParser.create().parse_overrides(overrides)
                if ov.is_sweep_override() and not ov.key_or_group.startswith("hydra")]
    searched += [f"{k}={v}" for k, v in study.items()]
    print(f"# hydra/sweeper={choices['sweeper']} searches: {' '.join(searched)}")
    print(OmegaConf.to_yaml(_compose(config_dir, config_name, fixed)))
    return 0
  total = _job_count(overrides, study)
  previous = HydraConfig.instance().cfg
  for number, values in enumerate(itertools.islice(itertools.product(*axes), MAX_SHOWN_JOBS)):
    # The job writes into the sweep's dir / subdir (conf/hydra/env/vmoe.yaml), not `workdir`;
    # subdir's ${hydra.job.num} and ${hydra:...} resolve against the job's Hydra config.
    job = _compose(config_dir, config_name, fixed + list(values), with_hydra=True)
    with open_dict(job):
      job.hydra.job.num = number
      HydraConfig.instance().set_config(job)
      job.workdir = os.path.join(str(job.hydra.sweep.dir), str(job.hydra.sweep.subdir))
      del job["hydra"]
    print(f"# job {number} of {total}: {' '.join(values) or '(no swept key)'}")
    print(OmegaConf.to_yaml(job))
  HydraConfig.instance().cfg = previous
  if total > MAX_SHOWN_JOBS:
    print(f"# ... and {total - MAX_SHOWN_JOBS} more jobs")
  return 0


# Hydra's flags that choose the mode of a command: at most one of them is valid, in Hydra's terms
# (spelled out as each's long form).
_MODE_FLAGS = {"-m": "--multirun", "--multirun": "--multirun", "-c": "--cfg", "--cfg": "--cfg",
               "-i": "--info", "--info": "--info", "-sc": "--shell-completion",
               "--shell-completion": "--shell-completion"}


def _modes(args: list[str]) -> set[str]:
  return {_MODE_FLAGS[a.partition("=")[0]] for a in args if a.partition("=")[0] in _MODE_FLAGS}


def _multirun(args: list[str]) -> bool:
  return "--multirun" in _modes(args)


def _submission_problem(launcher: dict) -> str | None:
  """Whether the launcher can start the jobs from here: SLURM reachable, the partition known."""
  if launchers.plugin_name(launcher) != "SlurmLauncher":
    return None
  from runner.parallel import slurm  # lazily, as every library module here
  problem = slurm.submission_problem(launcher.get("partition"))
  if problem:
    return (f"hydra/launcher=slurm submits the sweep's jobs with sbatch, but {problem}. Run the "
            "command where SLURM is reachable (a cluster's login node), or run the jobs on this "
            "machine: hydra/launcher=parallel (several at a time) or no launcher (one after "
            "another). docs/cluster.md shows both.")
  return None


def _quiet_library_noise() -> None:
  """Orbax/TensorStore report a failed read by absl ERROR lines and, after the error has reached
  us, "Event loop is closed" tracebacks from their callback threads and one "Exception ignored"
  traceback per array whose concurrent read was abandoned (dozens for a damaged checkpoint): the
  one-paragraph message says it all, so these are dropped (debug=true keeps them)."""
  logging.getLogger("absl").setLevel(logging.CRITICAL)
  default = sys.unraisablehook
  if getattr(default, "vmoe_quiet", False):
    return  # installed by an earlier command in this process (the demo, tests)

  def hook(unraisable):
    if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
        unraisable.exc_value):
      return
    if _abandoned_checkpoint_read(unraisable.object):
      return
    default(unraisable)
  hook.vmoe_quiet = True
  sys.unraisablehook = hook


def _abandoned_checkpoint_read(obj) -> bool:
  """A coroutine of the checkpoint library (Orbax) that Python collects unfinished: a read the
  library abandoned when another read of the same checkpoint failed."""
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


def _job(sub: str, existed: pathlib.Path | None = None):
  """The Hydra task function of stage `sub`; `existed`: the deepest folder of the workdir's path
  that existed before Hydra created it (what a refused run removes stops there)."""
  def job(cfg):
    from runner import weights
    from runner.tasks import run_task
    hydra_config = HydraConfig.get()
    workdir = hydra_config.runtime.output_dir
    new_workdir = (hydra_config.mode == RunMode.RUN
                   and refused_workdir.is_new(workdir, hydra_config.job.name))
    try:
      # A job in a process of its own (a launcher's: SLURM, the parallel one) registers the
      # built-ins and loads the plug-ins it was composed with before its config is typed.
      _register_builtins()
      plugins.load(cfg.get("plugins") or [])
      # Checked before launch; in the job it is checked once more, with its devices, as the
      # task starts (runner/tasks/common.py).
      typed = config_layer.load(sub, cfg, HydraConfig.get().runtime.output_dir, check=False,
                                checkpoints=weights)
      _sweep_identity(typed)
      metric = run_task(sub, typed, devices_checked=_devices_checked)
      if typed.logger.report and sub not in _NO_PAGE:
        _write_report(typed.workdir)
      return metric
    except VmoeError as e:
      if isinstance(e, UserError) and new_workdir:
        refused_workdir.remove(workdir, existed)  # nothing a later run could take for one
      if cfg.get("debug"):
        raise
      print(f"vmoe {sub}: error: {e}", file=sys.stderr)
      sys.exit(e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before the training loop took over the signal
      if cfg.get("debug"):
        raise
      print(f"vmoe {sub}: interrupted before training started; nothing was saved.",
            file=sys.stderr)
      sys.exit(130)
  return job


# Stages whose folder gets no report page: an export's is a model folder (its README.md is the card).
_NO_PAGE = ("export",)


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
  _quiet_environment()
  try:  # before the schemas reach Hydra: a plug-in adds names and keys to them
    plugins.load(plugins.requested(_split_args(rest)[1]))
    rest = _with_recorded_plugins(sub, rest)
  except UserError as e:
    print(f"vmoe {sub}: error: {e}", file=sys.stderr)
    return 2
  _register_builtins()
  import runner.config_store  # noqa: F401  (registers the schemas and model names with Hydra)
  if not any(arg.lstrip("+").lower() in ("debug=true", "debug=1") for arg in rest):
    _quiet_library_noise()
  problem = check_overrides(sub, rest)
  if problem:
    print(f"vmoe {sub}: error: {problem}", file=sys.stderr)
    return 2
  os.environ["VMOE_STAGE"] = sub  # what hydra/launcher=parallel starts in each job
  modes = _modes(rest)
  if len(modes) > 1 and modes != {"--multirun", "--cfg"}:
    print(f"vmoe {sub}: error: {' and '.join(sorted(modes))} each choose what the command does "
          "(run a sweep, show the config, show Hydra's information, shell completion); give one "
          "of them (--multirun with --cfg job shows every job's config).", file=sys.stderr)
    return 2
  if modes == {"--multirun", "--cfg"}:
    return _show_sweep(sub, rest)
  if any(a.replace(" ", "") == "hydra/sweeper=optuna" for a in rest) and not any(
      a.startswith("hydra.sweeper.direction") for a in rest):
    rest = rest + ["hydra.sweeper.direction=maximize"]  # each stage returns its main metric
  sys.argv = [f"vmoe {sub}"] + _overrides_first(rest)
  shows_help = any(a in ("-h", "--help") for a in rest)
  existed = None if modes or _split_args(rest)[2] else _workdir_existed(sub, rest)
  try:
    hydra.main(config_path=str(conf_dir()), config_name=sub, version_base=None)(
        _job(sub, existed))()
  finally:  # Hydra exits as soon as it has printed its help, or a sweep's job has failed
    sweep_table.print_stopped_sweep()  # a sweep that a failed job stopped: its table all the same
    if shows_help:
      print(_registered_names())
  return 0


def _with_recorded_plugins(sub: str, args: list[str]) -> list[str]:
  """A stage started from runs trained with plug-ins loads them too, and records them as its own
  `plugins=` (so a job in a process of its own, and the next stage, load them): their router
  families, models and evaluators are what those checkpoints need. Said in one line."""
  from runner import weights  # lazily, as every library module here
  overrides = _split_args(args)[1]
  given = plugins.requested(overrides)
  recorded = {}  # module -> the first run that recorded it
  for path in _init_checkpoints(overrides):
    try:
      stored = weights.stored_config(path) or {}
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
  kept = [a for a in args if a not in given_as]
  return kept + [f"plugins=[{names}]"]


def _init_checkpoints(overrides: list[str]) -> list[str]:
  """The paths `init.checkpoint=` names: one, or a list (ensemble, few-shot)."""
  for override in overrides:
    key, eq, value = override.partition("=")
    if eq and key.lstrip("+~") == "init.checkpoint":
      items = re.split(r"[,\[\]]+", value)
      return [item.strip().strip("'\"") for item in items if item.strip() not in ("", "null")]
  return []


def _workdir_existed(sub: str, args: list[str]) -> pathlib.Path:
  """The deepest folder of the run's workdir path that exists before Hydra creates the workdir."""
  flags, overrides, _ = _split_args(args)
  composed = _compose(flags.get("-cd") or flags.get("--config-dir"),
                      flags.get("-cn") or flags.get("--config-name") or sub,
                      _sweep_axes(overrides, {})[0])
  return refused_workdir.nearest_existing(str(composed.workdir))


def _register_builtins() -> None:
  """Imports the modules that register the built-in router families, evaluators, optimizers,
  schedules, preprocessing ops and corruptions, so that names are checked against all of them
  (lazily: `vmoe --help` stays fast)."""
  import runner.data  # noqa: F401
  import runner.evaluators  # noqa: F401
  import runner.models  # noqa: F401
  import runner.train.optimizers  # noqa: F401
  import runner.train.schedules  # noqa: F401


def _registered_names() -> str:
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


def entry() -> None:
  """The `vmoe` console script."""
  _reexec_with_jemalloc()
  sys.exit(main())


if __name__ == "__main__":
  sys.exit(main())
