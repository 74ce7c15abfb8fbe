"""Composing a stage's config with Hydra, and saying in one paragraph why a composition failed
(what was wrong and what is valid); `--multirun ... --cfg job` shows every job's config."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import os
import re
import sys

from hydra import compose as hydra_compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import configure_log, run_job
from hydra.types import HydraContext, RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from runner.command import arguments, launchers
from runner.config import conf_dir

MAX_SHOWN_JOBS = 64  # `--multirun --cfg job` prints this many jobs' configs at most
_RUN_MODE = "hydra.mode=RUN"  # what Hydra's run adds to the overrides of a config with no mode
# Hydra's name for the task (`hydra.job.name`, the log file's name): its run names the job after
# the task function's module, runner/command/job.py; the compose API takes the name given.
JOB_NAME = "job"


# Options of hydra/launcher and hydra/sweeper that plugins of the cluster extra provide.
_PLUGIN_CONFIGS = {"submitit_slurm": "hydra-submitit-launcher",
                   "submitit_local": "hydra-submitit-launcher", "optuna": "hydra-optuna-sweeper"}


def register_requested_models(overrides: list[str]) -> None:
  """model=<name> in the catalog grammar (vmoe_b16_every2_e32_k2) becomes a `model` option."""
  from runner.command.config_store import register_model
  from runner.models import catalog
  for ov in overrides:
    key, _, value = ov.partition("=")
    if key.lstrip("+~") == "model":
      for name in value.split(","):
        # An unknown name: Hydra / the check below reports it with the list of valid names.
        with contextlib.suppress(catalog.UnknownModelError):
          register_model(name.strip())


def explain_composition_error(err: Exception, sub: str, overrides: list[str],
                               config_dir: str | None, config_name: str) -> str:
  """One paragraph for a failed composition: what was wrong and what is valid."""
  from runner.models import catalog
  cause = err.__cause__ or err
  if isinstance(err, arguments.SearchRangeError):
    return str(err)
  missing = re.search(r"Could not (?:find|load) '([^']+)'", str(err))
  if missing and (plugin := _PLUGIN_CONFIGS.get(missing[1].rsplit("/", 1)[-1])):
    return (f"{missing[1]} comes from the {plugin} plugin, which is not installed: install the "
            "cluster extra, pip install -e '.[cluster]' (make test installs it).")
  if type(err).__name__ == "OverrideParseException":
    return (f"cannot parse the overrides {overrides}: {str(err).splitlines()[0]}. Values with "
            "parentheses, commas, spaces or '|' must be quoted for Hydra, e.g. "
            "'data.pp=\"decode(3)|resize(32)|value_range(-1,1)\"' (single quotes for the shell).")
  full_key = getattr(cause, "full_key", None)
  lines = str(err).split("\n")
  text = lines[0]
  if "Could not find" in str(err):  # unknown option of a group
    group = text.split("'")[-2].rsplit("/", 1)[0] if "'" in text else "?"
    options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
    if group == "model":
      try:
        catalog.model_config(text.split("'")[-2].split("/", 1)[-1])
      except catalog.UnknownModelError as e:
        return str(e)
    return (f"{text.split(': ', 1)[-1]}. Valid options for {group}=: {', '.join(options)}.")
  if full_key:
    parent, _, leaf = full_key.rpartition(".")
    valid = ""
    with contextlib.suppress(Exception):  # the base config itself is broken: say what we know
      base = compose(config_dir, config_name, [])
      node = OmegaConf.select(base, parent) if parent else base
      if node is not None and OmegaConf.is_dict(node):
        valid = f" Valid keys under {parent or 'the top level'}: {', '.join(node.keys())}."
    if type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError"):
      return f"unknown config key {full_key!r}.{valid} Run `vmoe {sub} --cfg job` to see every key."
    reason = str(cause).split("\n")[0]
    return f"bad value for {full_key}: {reason}."
  return f"cannot compose the {sub} config from {overrides}: {' '.join(str(err).split())}"


def compose(config_dir: str | None, config_name: str, overrides: list[str],
             with_hydra: bool = False):
  primary, extra = str(conf_dir()), []
  if config_dir:  # as Hydra's --config-dir: that folder first, conf/ still searched
    primary = os.path.abspath(config_dir)
    extra = [f"hydra.searchpath=[file://{conf_dir()}]"]
  with initialize_config_dir(config_dir=primary, job_name=JOB_NAME, version_base=None):
    return hydra_compose(config_name, overrides=extra + overrides, return_hydra_config=with_hydra)


@dataclasses.dataclass(frozen=True)
class Composition:
  """A run's config and its `hydra` node, as the pre-flight checks composed them (run_composed)."""
  config_name: str
  config: DictConfig


class _Callbacks:
  """The run's `hydra.callbacks` (conf/hydra/env/vmoe.yaml's and a user's), called as Hydra's
  run calls them: the starts in order, the ends in reverse."""

  def __init__(self, config: DictConfig):
    self._callbacks = [instantiate(node) for node in (config.hydra.callbacks or {}).values()]

  def __getattr__(self, event: str):
    ordered = self._callbacks if event.endswith("_start") else self._callbacks[::-1]
    return lambda **kwargs: [getattr(callback, event)(**kwargs) for callback in ordered]


def run_composed(composition: Composition, task_function) -> None:
  """Runs `task_function` on the config the pre-flight checks composed, as Hydra's run does (the
  run's folder, .hydra files, logging, callbacks; `hydra.mode=RUN` added where no mode is set),
  with Hydra's public job runner (`hydra.core.utils.run_job`, what launchers call), but without
  Hydra's two more compositions (one for `hydra.mode`, one for the job: about 0.1 s each)."""
  config = composition.config
  with read_write(config.hydra), open_dict(config.hydra):
    if config.hydra.mode is None:
      config.hydra.mode = RunMode.RUN
      config.hydra.overrides.hydra.append(_RUN_MODE)
  configure_log(config.hydra.hydra_logging, config.hydra.verbose)
  callbacks = _Callbacks(config)
  callbacks.on_run_start(config=config, config_name=composition.config_name)
  ran = run_job(task_function=task_function, config=config, job_dir_key="hydra.run.dir",
                job_subdir_key=None,
                hydra_context=HydraContext(config_loader=None, callbacks=callbacks))
  callbacks.on_run_end(config=config, config_name=composition.config_name, job_return=ran)
  _ = ran.return_value  # a job that raised raises here, as in Hydra's run


def study_params(choices: dict) -> dict:
  """A sweep study's `hydra.sweeper.params` (empty for the primary configs)."""
  return dict(OmegaConf.to_container(choices["params"])) if choices["params"] else {}


def hydra_choices(config_dir: str | None, config_name: str, overrides: list[str]) -> dict:
  """The sweep's Hydra config composed with the hydra.* overrides (a launcher's or sweeper's option
  of the wrong type fails here): the launcher and sweeper chosen, a study's hydra.sweeper.params."""
  first = arguments.sweep_axes(overrides, {})[0]
  hydra_given = [o for o in overrides if o.lstrip("+~").startswith("hydra")]
  composed = compose(config_dir, config_name, first + hydra_given, with_hydra=True)
  # A run takes it (run_composed); with -cd, compose() adds a search path that Hydra's own
  # composition does not have, and Hydra's run composes it instead.
  composition = None if config_dir else Composition(config_name, copy.deepcopy(composed))
  node = composed.hydra
  with open_dict(composed):
    del composed["hydra"]
  return {"launcher": node.runtime.choices.get("hydra/launcher", "basic"),
          "sweeper": node.runtime.choices.get("hydra/sweeper", "basic"),
          "params": node.sweeper.get("params"), "mode": node.get("mode"),
          "plugins": {section: OmegaConf.to_container(node[section], resolve=False,
                                                      enum_to_str=True)
                      for section in ("launcher", "sweeper")},
          "job": first, "composed": composed,  # the job without sweep values, composed
          "composition": composition}


def show_sweep(sub: str, args: list[str]) -> int:
  """`--multirun ... --cfg job` (Hydra refuses the pair): each job's config, its own folder as its
  workdir; a search (hydra/sweeper=optuna): its fixed config and the ranges searched."""
  flags, overrides, _ = arguments.split_args(args)
  if (what := flags.get("--cfg") or flags.get("-c")) != "job":
    print(f"vmoe {sub}: error: --cfg {what} with --multirun: Hydra shows the {what} config of "
          "one run only. Drop --multirun to see it, or use --cfg job to see every job of the "
          "sweep.", file=sys.stderr)
    return 2
  config_dir = flags.get("-cd") or flags.get("--config-dir")
  config_name = flags.get("-cn") or flags.get("--config-name") or sub
  choices = hydra_choices(config_dir, config_name, overrides)
  study = study_params(choices)
  fixed, axes = arguments.sweep_axes(overrides, study)
  if launchers.plugin_name(choices["plugins"]["sweeper"]) != "BasicSweeper":
    searched = [ov.input_line for ov in OverridesParser.create().parse_overrides(overrides)
                if ov.is_sweep_override() and not ov.key_or_group.startswith("hydra")]
    searched += [f"{k}={v}" for k, v in study.items()]
    print(f"# hydra/sweeper={choices['sweeper']} searches: {' '.join(searched)}")
    print(OmegaConf.to_yaml(compose(config_dir, config_name, fixed)))
    return 0
  total = arguments.job_count(overrides, study)
  previous = HydraConfig.instance().cfg
  for number, values in enumerate(itertools.islice(itertools.product(*axes), MAX_SHOWN_JOBS)):
    # The job writes into the sweep's dir / subdir (conf/hydra/env/vmoe.yaml), not `workdir`;
    # subdir's ${hydra.job.num} and ${hydra:...} resolve against the job's Hydra config.
    job = compose(config_dir, config_name, fixed + list(values), with_hydra=True)
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
