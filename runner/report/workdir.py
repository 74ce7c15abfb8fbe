"""What a run's workdir records, read into one `Run`: the page is drawn from this alone.

Only what the files say is shown (docs/report.md lists them); for a run of an older vmoe, W&B's
metadata stands in for environment.json when it wrote some."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import re
import socket

import yaml

from runner.config import subcommands
from runner.report import curves as curves_lib
from runner.workdirs.workdir_lock import LOCK_FILE, is_held

# The stages a run page names (export writes a model folder, whose README.md is its card).
STAGES = tuple(name for name, sub in subcommands.SUBCOMMANDS.items()
               if sub.is_stage and sub.has_run_page)
# runner/workdirs/workdir_lock.py writes this line when a process takes the workdir.
_HOLDER = re.compile(r"pid (\d+) on host (\S+), started ([\d-]+ [\d:]+): (.*)")
_TIME = "%Y-%m-%d %H:%M:%S"


@dataclasses.dataclass
class Checkpoint:
  step: int
  complete: bool  # Orbax wrote its commit marker
  size: int  # bytes


@dataclasses.dataclass
class Origin:
  """Where the stage started from (init.checkpoint): the config's text, and the run it names."""
  text: str
  run: pathlib.Path | None  # None unless that run folder exists here


@dataclasses.dataclass
class Holder:
  """The last process that held the workdir, as .vmoe.lock records it."""
  pid: int
  host: str
  started: str
  command: str


@dataclasses.dataclass
class Run:
  path: pathlib.Path
  stage: str  # "" when no file says
  overrides: list[str]
  config: dict
  config_text: str
  summary: dict
  curves: curves_lib.Curves
  pictures: list[pathlib.Path]
  checkpoints: list[Checkpoint]
  origins: list[Origin]
  holder: Holder | None
  facts: list[tuple[str, str]]  # (what, value): when, where and with what it ran


def is_run(path: pathlib.Path) -> bool:
  return (path / "summary.json").is_file() or (path / "metrics.jsonl").is_file()


def read(path: str | pathlib.Path) -> Run:
  path = pathlib.Path(path)
  summary = _json(path / "summary.json")
  config_text = _text(path / "config.yaml")
  config = _yaml(config_text)
  holder = read_holder(path)
  run = Run(path=path, stage=stage(path, holder, summary),
            overrides=[str(o) for o in (_yaml(_text(path / ".hydra" / "overrides.yaml")) or [])],
            config=config if isinstance(config, dict) else {}, config_text=config_text,
            summary=summary, curves=curves_lib.read(path / "metrics.jsonl"),
            pictures=sorted(path.glob("*.png")), checkpoints=_checkpoints(path),
            origins=[], holder=holder, facts=[])
  run.origins = _origins(path, run.config)
  run.facts = _facts(run)
  return run


def read_holder(path: pathlib.Path) -> Holder | None:
  match = _HOLDER.match(_text(path / LOCK_FILE).strip())
  return Holder(int(match[1]), match[2], match[3], match[4]) if match else None


def held_by_another_process(path: str | pathlib.Path) -> bool:
  """Whether the run is still going: another process holds the flock a vmoe process keeps on
  <workdir>/.vmoe.lock while it works there (runner/workdirs/workdir_lock.py), which the kernel
  drops however that process ends; `is_held` probes it without changing the file."""
  if not is_held(path):
    return False
  holder = read_holder(pathlib.Path(path))
  # This process's own lock (a stage writing its page before it lets go) is not another run.
  return not (holder and holder.pid == os.getpid() and holder.host == socket.gethostname())


def _text(path: pathlib.Path) -> str:
  try:
    return path.read_text(errors="replace")
  except OSError:
    return ""


def _yaml(text: str):
  try:
    return yaml.safe_load(text)
  except yaml.YAMLError:
    return None


def _json(path: pathlib.Path) -> dict:
  try:
    value = json.loads(path.read_text())
  except (OSError, ValueError):
    return {}
  return value if isinstance(value, dict) else {}


def _hydra(path: pathlib.Path) -> dict:
  node = _yaml(_text(path / ".hydra" / "hydra.yaml"))
  return node.get("hydra", {}) if isinstance(node, dict) else {}


def stage(path: pathlib.Path, holder: Holder | None, summary: dict) -> str:
  """The subcommand: from the command line that ran it, else Hydra's config name, else (as
  `vmoe summarize` does) from the summary's keys."""
  if holder:
    words = holder.command.split()
    if len(words) > 1 and words[1] in STAGES:
      return words[1]
  name = str(_hydra(path).get("job", {}).get("config_name", ""))
  if name in STAGES:
    return name
  return subcommands.stage_of(summary) if summary else ""


def _checkpoints(path: pathlib.Path) -> list[Checkpoint]:
  folder = path / "checkpoints"
  found = [Checkpoint(int(step.name), (step / "commit_success.txt").exists(),
                      sum(f.stat().st_size for f in step.rglob("*") if f.is_file()))
           for step in (folder.iterdir() if folder.is_dir() else ())
           if step.is_dir() and step.name.isdigit()]
  return sorted(found, key=lambda c: c.step)


def _origins(path: pathlib.Path, config: dict) -> list[Origin]:
  """init.checkpoint, each entry resolved against the directory the stage ran in (if relative)."""
  init = config.get("init")
  value = init.get("checkpoint") if isinstance(init, dict) else None
  if not value:
    return []
  cwd = pathlib.Path(str(_hydra(path).get("runtime", {}).get("cwd") or os.getcwd()))
  return [Origin(str(text), _run_folder(cwd / pathlib.Path(str(text)).expanduser()))
          for text in (value if isinstance(value, list) else [value])]


def _run_folder(path: pathlib.Path) -> pathlib.Path | None:
  """The run folder holding a checkpoint path (the workdir itself, or a folder up to two levels
  above: <run>/checkpoints/<step>)."""
  for folder in (path, path.parent, path.parent.parent):
    if folder.is_dir() and (is_run(folder) or (folder / "config.yaml").is_file()):
      return folder
  return None


def _facts(run: Run) -> list[tuple[str, str]]:
  facts = []
  if run.stage:
    facts.append(("stage", run.stage))
  if run.holder:
    facts += [("command", run.holder.command), ("host", run.holder.host),
              ("started (last process to hold the workdir)", run.holder.started)]
  summary = run.path / "summary.json"
  if summary.is_file():
    finished = datetime.datetime.fromtimestamp(summary.stat().st_mtime)
    facts.append(("finished (summary.json written)", finished.strftime(_TIME)))
    if run.holder:
      try:
        took = finished - datetime.datetime.strptime(run.holder.started, _TIME)
      except ValueError:
        took = None
      if took is not None and took.total_seconds() >= 0:
        facts.append(("wall time (start to summary)", _duration(took.total_seconds())))
  metrics = run.path / "metrics.jsonl"
  if metrics.is_file() and not summary.is_file():  # unfinished: how fresh the curves are
    last = datetime.datetime.fromtimestamp(metrics.stat().st_mtime).strftime(_TIME)
    facts.append(("metrics.jsonl last written", last))
  train = run.config.get("train")
  steps = train.get("steps") if isinstance(train, dict) else None
  if run.curves.last_step is not None:
    of = f" of {steps}" if isinstance(steps, int) and run.stage in ("pretrain", "finetune") else ""
    facts.append(("last logged step", f"{run.curves.last_step}{of}"))
  environment = _json(run.path / "environment.json")  # runner/logging/environment.py
  facts += _environment_facts(environment)
  facts += _wandb_facts(run.path, known=bool(environment))
  return facts


def _environment_facts(environment: dict) -> list[tuple[str, str]]:
  """What the run ran on, as the stage recorded it in environment.json."""
  facts = [(what, str(environment[key])) for key, what in (
      ("git_commit", "vmoe git commit"), ("devices", "devices"), ("processes", "processes"),
      ("python", "Python")) if environment.get(key) is not None]
  packages = environment.get("packages")
  if isinstance(packages, dict) and packages:
    facts.append(("packages", ", ".join(f"{k} {v}" for k, v in packages.items())))
  return facts


def _duration(seconds: float) -> str:
  minutes, secs = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours} h {minutes:02d} min {secs:02d} s" if hours else f"{minutes} min {secs:02d} s"


def _wandb_facts(path: pathlib.Path, known: bool = False) -> list[tuple[str, str]]:
  """The W&B run folder, and from its wandb-metadata.json the git commit and the devices unless
  the run recorded them itself (`known`; a run of an older vmoe did not)."""
  runs = sorted((path / "wandb").glob("*run-*"))
  if not runs:
    return []
  facts = [("W&B run", runs[-1].name)]
  if known:
    return facts
  meta = _json(runs[-1] / "files" / "wandb-metadata.json")
  git = meta.get("git") if isinstance(meta.get("git"), dict) else {}
  if git.get("commit"):
    facts.append(("git commit", str(git["commit"])))
  if meta.get("gpu"):
    facts.append(("devices", f"{meta.get('gpu_count', '?')} x {meta['gpu']}"))
  if meta.get("cpu_count"):
    facts.append(("CPU cores", str(meta["cpu_count"])))
  return facts
