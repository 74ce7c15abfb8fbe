"""Every file in conf/ and sweeps/ composes against the typed schemas, and resolves."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runner.config import conf_dir, validate
from runner.config.resolve import train_task
from runner.errors import ConfigError
from runner.models import catalog

CONF = conf_dir()
SWEEPS = CONF.parent / "sweeps"
PRIMARY = ["pretrain", "finetune", "fewshot", "eval", "ensemble", "export", "compress"]
GROUPS = {group: sorted(p.stem for p in (CONF / group).glob("*.yaml"))
          for group in ("data", "optim", "schedule", "experiment", "sharding", "objective")}
# Hydra's own groups: the shared settings and the launchers' options.
HYDRA_GROUPS = {group: sorted(p.stem for p in (CONF / group).glob("*.yaml"))
                for group in ("hydra/env", "hydra/launcher")}


def _compose(name, overrides=(), config_dir=CONF, extra_dir=None, with_hydra=False):
  extra = [f"hydra.searchpath=[file://{extra_dir}]"] if extra_dir else []
  with initialize_config_dir(config_dir=str(config_dir), version_base=None):
    return compose(name, overrides=extra + list(overrides), return_hydra_config=with_hydra)


def _resolved(cfg):
  # data.root is mandatory for image_folder and captions, and tfds needs a name: the tests give
  # them values to resolve.
  return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def _validated(cfg):
  """The typed config of a stage that reads no checkpoint, checked as the CLI checks it before
  launch (runner/command/preflight.py): every key's declared check, then the relations; raises
  one ConfigError naming each problem."""
  return validate(train_task(cfg, "/tmp/w"))


def test_every_file_in_conf_is_covered():
  """A new config file must be added to one of the lists this module composes."""
  files = {p.relative_to(CONF).with_suffix("").as_posix() for p in CONF.rglob("*.yaml")}
  covered = set(PRIMARY) | {f"{g}/{o}" for g, options in {**GROUPS, **HYDRA_GROUPS}.items()
                            for o in options}
  assert files == covered


def test_every_stage_shares_the_hydra_settings():
  """conf/hydra/env/vmoe.yaml: a run writes into its workdir, a sweep's jobs into numbered
  folders of it; no primary config repeats a hydra: block."""
  for name in PRIMARY:
    overrides = ["init.checkpoint=runs/x"] if name in ("eval", "ensemble", "export", "compress") else []
    hydra = _compose(name, overrides + ["workdir=runs/w"], with_hydra=True).hydra
    sweep = OmegaConf.to_container(hydra.sweep, resolve=False)
    assert (hydra.run.dir, sweep["dir"], sweep["subdir"]) == (
        "runs/w", "${workdir}", "${hydra.job.num}")
    assert hydra.job_logging.root.level == "WARNING"
    assert "\nhydra:" not in (CONF / f"{name}.yaml").read_text()


@pytest.mark.parametrize("launcher", HYDRA_GROUPS["hydra/launcher"])
def test_launchers_compose(launcher):
  hydra = _compose("pretrain", [f"hydra/launcher={launcher}"], with_hydra=True).hydra
  expected = {"slurm": "SlurmLauncher", "parallel": "ParallelLauncher"}[launcher]
  assert hydra.launcher._target_.endswith(expected)


@pytest.mark.parametrize("name", PRIMARY)
def test_primary_configs_compose_and_resolve(name):
  overrides = ["init.checkpoint=runs/x"] if name in ("eval", "ensemble", "export", "compress") else []
  cfg = _compose(name, overrides)
  config = _resolved(cfg)
  assert set(config) >= {"seed", "workdir", "debug", "logger"}
  if name in ("pretrain", "finetune"):  # the others are checked with their checkpoints' configs
    _validated(cfg)


# What a group option needs beside it to make a valid run with pretrain's defaults (the checks
# name it when it is missing): caption data trains the contrastive objective, and rsqrt's warm-up
# and 50,000-step cooldown must fit the 220-step run (docs/training.md's example).
COMPANIONS = {
    ("data", "captions"): (["objective=contrastive"], "objective=contrastive"),
    ("data", "coco_captions"): (["objective=contrastive"], "objective=contrastive"),
    ("schedule", "rsqrt"): (["schedule.warmup_steps=100", "schedule.cooldown_steps=50"],
                            r"warmup_steps \+ cooldown_steps <= 220"),
}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_group_options_compose_with_pretrain(group, option):
  overrides = [f"{group}={option}"]
  if option == "image_folder":
    overrides.append("data.root=/some/folder")
  if group == "data" and option == "captions":
    overrides.append("data.root=/some/pairs.jsonl")
  if option == "tfds":
    overrides.append("data.name=cifar10")
  companions, refused = COMPANIONS.get((group, option), ([], None))
  if refused:
    with pytest.raises(ConfigError, match=refused):
      _validated(_compose("pretrain", overrides))
  cfg = _compose("pretrain", overrides + companions)
  _validated(cfg)
  config = _resolved(cfg)
  if group == "data":
    assert str(config["model"]["image_size"]) in config["data"]["pp"]
    # an image-text dataset names its caption feature; a classification one names none
    assert bool(config["data"]["text_key"]) == ("captions" in option)
  if group == "objective":
    assert config["objective"]["name"] == option
    if option == "contrastive":  # it brings image-caption data (embedded by default)
      assert config["data"]["text_key"]


@pytest.mark.parametrize("name", catalog.CPU_MODELS + catalog.PAPER_MODELS
                         + catalog.SOFT_MOE_MODELS)
def test_every_catalog_model_composes(name):
  cfg = _compose("pretrain", [f"model={name}"])
  assert _validated(cfg).model.name == name
  config = _resolved(cfg)
  assert config["model"]["name"] == name


@pytest.mark.parametrize("study", sorted(p.stem for p in SWEEPS.glob("*.yaml")))
def test_sweep_studies_compose_as_multirun(study):
  extra = ["init.checkpoint=runs/x"] if "eval" in study else []
  hydra = _compose(study, extra, config_dir=SWEEPS, extra_dir=CONF, with_hydra=True).hydra
  assert hydra.mode.name == "MULTIRUN"
  assert hydra.sweeper.params, "a study must sweep something"
  cfg = _compose(study, extra, config_dir=SWEEPS, extra_dir=CONF)
  for key, values in hydra.sweeper.params.items():  # each swept key exists, each value composes
    if key not in GROUPS:  # a config group (experiment=...) is not a key of the config
      assert OmegaConf.select(cfg, key, default="missing") != "missing", key  # None: "unchanged"
    for value in str(values).split(","):
      job = _compose(study, extra + [f"{key}={value}"], config_dir=SWEEPS, extra_dir=CONF)
      _resolved(job)
      if "init" not in job or not job.init.checkpoint:  # a stage that reads no checkpoint
        validate(train_task(job, "/tmp/w"))  # each job's values are valid, relations included


def test_sweeps_readme_lists_every_study():
  text = (SWEEPS / "README.md").read_text()
  for path in SWEEPS.glob("*.yaml"):
    assert f"`{path.stem}`" in text, path.stem


def test_eval_overrides_are_optional():
  cfg = _compose("eval", ["init.checkpoint=runs/x", "model.router.k=1", "data=uci_digits"])
  assert cfg.model.router.k == 1 and cfg.model.hidden_size is None
  assert cfg.data.name == "uci_digits"


def test_compositions_never_change_the_store():
  """What one composition's config changes reaches neither vmoe's config store nor the next
  composition."""
  from runner.command.config_store import VmoeStore
  store = VmoeStore()
  first = _compose("pretrain", ["model=vmoe_tiny"])
  first.model.hidden_size, first.optim.lr = 7, 0.5
  again = _compose("pretrain", ["model=vmoe_tiny"])
  assert again.model.hidden_size == catalog.model_config("vmoe_tiny").hidden_size != 7
  assert again.optim.lr != 0.5
  assert store.load("model/vmoe_tiny.yaml").node.hidden_size != 7


@pytest.mark.parametrize("args, mode, jobs", [
    ([], "RUN", 1),
    (["-cd", str(SWEEPS), "-cn", "pretrain_k"], "MULTIRUN", 4),  # the study sets hydra.mode
    (["hydra.mode=MULTIRUN", "seed=0,1"], "MULTIRUN", 2),
])
def test_the_run_mode_is_the_one_the_checks_composed(args, mode, jobs, run_cli, monkeypatch,
                                                     tmp_path):
  """The `hydra.mode` a config sets decides without --multirun: a study that sets MULTIRUN
  sweeps (Hydra's run), a plain command runs once (compose.run_composed)."""
  from hydra.core.hydra_config import HydraConfig
  from runner import tasks
  seen = []
  monkeypatch.setattr(tasks, "run_task", lambda sub, typed, checkpoints, devices_checked:
                      seen.append(HydraConfig.get().mode.name) or 0.0)
  code, _, err = run_cli("pretrain", *args, f"workdir={tmp_path / 'run'}",
                         f"hydra.sweep.dir={tmp_path / 'sweep'}", "logger.wandb.mode=disabled")
  assert code == 0, err
  assert seen == [mode] * jobs


@pytest.mark.parametrize("args", [
    [], ["model=vmoe_tiny", "seed=3", "hydra.job.name=mine"], ["hydra.job.name=mine", "seed=3"]])
def test_a_run_takes_the_config_the_checks_composed(args, run_cli, monkeypatch, tmp_path):
  """A plain run takes the config the pre-flight checks composed (compose.run_composed, Hydra's
  public run_job) instead of Hydra's run composing it twice more: the job gets the config, and
  the run's folder the .hydra files (Hydra's node, its mode and job name included), that Hydra's
  own run gives; so does `--cfg all`, which Hydra's run shows."""
  from hydra.core.hydra_config import HydraConfig
  from runner.command import compose, job, preflight
  runs, jobs = [], []
  run_composed = compose.run_composed
  monkeypatch.setattr(compose, "run_composed", lambda *a: runs.append(a) or run_composed(*a))
  monkeypatch.setattr(job.Job, "__call__", lambda self, cfg: jobs.append(
      (OmegaConf.to_yaml(cfg), OmegaConf.to_yaml(HydraConfig.get()))) or 0.0)
  workdir = tmp_path / "run"

  def run() -> tuple:
    """(the job's config and Hydra node, the .hydra files, `--cfg all`) and the runs taken."""
    before = len(runs)
    code, _, err = run_cli("pretrain", f"workdir={workdir}", *args)
    assert code == 0, err
    files = {p.name: p.read_text() for p in sorted((workdir / ".hydra").iterdir())}
    shutil.rmtree(workdir)
    code, shown, err = run_cli("pretrain", f"workdir={workdir}", *args, "--cfg", "all")
    assert code == 0, err
    return (jobs.pop(), files, shown), len(runs) - before

  taken, reused = run()
  check = preflight.check
  monkeypatch.setattr(preflight, "check", lambda *a, **k: dataclasses.replace(
      check(*a, **k), composition=None))
  composed, not_reused = run()  # Hydra's own run
  assert (reused, not_reused) == (1, 0)
  assert taken == composed
  assert sorted(taken[1]) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
  job_name = "mine" if "hydra.job.name=mine" in args else compose.JOB_NAME
  assert f"\n  job:\n    name: {job_name}\n" in taken[2]
  assert "mode: RUN" in taken[0][1]


@pytest.mark.parametrize("args", [[], ["model=vit_s32", "optim=sgd"]])
def test_help_is_hydras_own_from_one_composition(args, run_cli, monkeypatch):
  """`vmoe pretrain --help` prints what Hydra's help prints (its template, the config groups, the
  composed config) and the registered names, composing once where Hydra's help copies its config
  repository for each group; with -cd, Hydra's own help runs."""
  from runner.command import help_page
  code, ours, _ = run_cli("pretrain", *args, "--help")
  assert code == 0
  monkeypatch.setattr(help_page, "main", lambda *a, **k: pytest.fail("not Hydra's help"))
  code, hydras, _ = run_cli("pretrain", *args, "--help", "-cd", str(conf_dir()))
  assert code == 0 and ours == hydras
  assert "== Configuration groups ==" in ours and "model: " in ours and "vmoe_tiny" in ours
  assert ("patch_size: 32" in ours) == bool(args) and "== Registered names" in ours


def test_help_with_a_bad_override_is_one_paragraph(run_cli):
  code, out, err = run_cli("pretrain", "optim.nope=1", "--help")
  assert code == 2 and not out
  assert "unknown config key 'optim.nope'" in err and "Traceback" not in err
