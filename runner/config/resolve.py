"""From a composed config to the typed, validated object a task runs.

eval and fewshot take the model and data from the checkpoint's stored config, with the command
line's non-null `model.*`/`data.*` keys on top. The caller's `CheckpointReader` reads the
checkpoints: the config layer sits below everything that knows checkpoint formats.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Protocol

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (InterpolationResolutionError, MissingMandatoryValue,
                              OmegaConfBaseException)

from runner.config.schema import (CompressRun, DataConfig, EnsembleMember, EnsembleRun, EvalRun,
                                  ExportRun, FewshotMember, FewshotRun, InitConfig, Loss, ModelConfig,
                                  DEFAULT_ROUTER, Objective, ObjectiveConfig, RunFields, TextConfig,
                                  TrainConfig, TrainTask)
from runner.config import registries, sections, subcommands
from runner.config.validate import validate
from runner.errors import ConfigError


def typed(node):
  """OmegaConf node -> dataclass instance, with unset or unresolvable values as ConfigErrors."""
  try:
    return OmegaConf.to_object(node)
  except MissingMandatoryValue as e:
    raise ConfigError(f"{e.full_key} has no value and needs one: add {e.full_key}=<value> "
                      "(for data=image_folder: data.root=<dir with train/ and test/>; for data=captions: "
                      "data.root=<a JSONL or CSV file of image-caption pairs, or its folder>).") from None
  except InterpolationResolutionError as e:
    raise ConfigError(f"cannot resolve {e.full_key}: {str(e).splitlines()[0]}") from None
  except OmegaConfBaseException as e:
    key = getattr(e, "full_key", None) or "the config"
    raise ConfigError(f"bad value for {key}: {str(e).splitlines()[0]}") from None


def from_dict(schema, values: dict):
  """A typed `schema` instance from plain values (unknown keys are an error), defaults filled in."""
  try:
    return typed(OmegaConf.merge(OmegaConf.structured(schema), values))
  except OmegaConfBaseException as e:
    key = getattr(e, "full_key", None) or schema.__name__
    raise ConfigError(f"bad value for {key}: {str(e).splitlines()[0]}") from None


def as_dict(config) -> dict:
  """A typed config as plain JSON-able Python (enums as their names), for files and W&B."""
  return OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)


class CheckpointReader(Protocol):
  """What a checkpoint says about itself; runner.checkpoints.weights.Checkpoints is one."""

  def stored_config(self, path: str) -> dict | None:
    """The config stored with one of our checkpoints; None for a released one (it has none)."""

  def describe(self, path: str) -> str:
    """'a google-research/vmoe checkpoint (hidden size 512, ...)', for error messages."""

  def architecture(self, path: str):
    """What a timm or transformers checkpoint's files say its ViT is; None for the other kinds
    (a reader without this method: none is checked)."""


def train_task(cfg: DictConfig, workdir: str) -> TrainTask:
  task = typed(cfg)
  task.workdir = str(workdir)
  return task


# --- stored configs ----------------------------------------------------------------------------

def _known(schema, stored: dict) -> dict:
  """The keys of `stored` that `schema` has (a checkpoint of an older version may have others)."""
  types = typing.get_type_hints(sections.fields_class(schema))
  return {name: _known(types[name], value)
          if dataclasses.is_dataclass(types[name]) and isinstance(value, dict) else value
          for name, value in (stored or {}).items() if name in types}


def _prune_none(tree):
  """The tree without None leaves and without the sub-trees left empty by that."""
  if isinstance(tree, dict):
    pruned = {k: _prune_none(v) for k, v in tree.items() if v is not None}
    return {k: v for k, v in pruned.items() if v != {}}
  return tree


def model_overrides(given: dict | None, stored: dict | None = None) -> dict:
  """Given `model.*` keys (None = unchanged), the router's as they apply at inference
  (`RouterFamily.at_inference`: for a token-choice router a given capacity_ratio is also the
  inference one)."""
  changes = _prune_none(dict(given or {}))
  router = changes.get("router") or {}
  family = _router_family(router.get("type")
                          or ((stored or {}).get("router") or {}).get("type"))
  layers = (changes.get("moe") or {}).get("layers", ((stored or {}).get("moe") or {}).get("layers"))
  if router and layers and family is not None:  # a dense ViT has no router to run
    changes["router"] = family.at_inference(router)
  return changes


def _router_family(router_type: str | None):
  """The family a stored or given router type names (None: the schema's default); None for an
  unknown one, which the schema's check reports."""
  try:
    return registries.ROUTERS.get(str(router_type or DEFAULT_ROUTER))
  except ConfigError:
    return None


def _keeps_what_was_trained(stored: dict, model: dict) -> None:
  """A later stage may change how a checkpoint runs (router k, capacity, BPR, dtype), not what it
  is: its partitioned batch ensemble, nor what the chosen family says it may not change
  (`later_stage_problem`: for Soft MoE the keys that size its slots, parameters)."""
  stored_moe, given_moe = stored.get("moe") or {}, (model.get("moe") or {})
  for key, default in (("ensemble_size", 1), ("ensemble_variant", "pbe")):
    given, kept = given_moe.get(key), stored_moe.get(key, default)
    if given is not None and str(given) != str(kept):
      raise ConfigError(
          f"model.moe.{key}={given} differs from the checkpoint's {kept}: the members of a "
          "partitioned batch ensemble are fixed when it is trained. Fine-tune it into another "
          "ensemble (vmoe finetune init.checkpoint=... model.moe.ensemble_size=<M> "
          "init.repartition_experts=true), or drop the override.")
  stored_router, given_router = stored.get("router") or {}, model.get("router") or {}
  family = _router_family(given_router.get("type") or stored_router.get("type"))
  if not stored_router or family is None:
    return
  if problem := family.later_stage_problem(stored_router, given_router):
    raise ConfigError(problem)


def stored_model_and_data(stored: dict, model: dict | None = None,
                          data: dict | None = None) -> tuple[ModelConfig, DataConfig]:
  """The checkpoint's model and data configs with the given (unresolved) overrides on top."""
  _keeps_what_was_trained(stored.get("model") or {}, _prune_none(dict(model or {})))
  base = OmegaConf.create({"model": OmegaConf.structured(ModelConfig),
                           "data": OmegaConf.structured(DataConfig)})
  try:
    merged = OmegaConf.merge(
        base, {"model": _known(ModelConfig, stored.get("model")),
               "data": _known(DataConfig, stored.get("data"))},
        {"model": model_overrides(model, stored.get("model")), "data": _prune_none(dict(data or {}))})
  except OmegaConfBaseException as e:
    key = getattr(e, "full_key", None) or "the stored config"
    raise ConfigError(f"bad value for {key}: {str(e).splitlines()[0]}") from None
  return typed(merged.model), typed(merged.data)


def stored_loss(stored: dict) -> Loss:
  if stored_objective(stored) == Objective.contrastive:
    return Loss.softmax_xent  # zero-shot: a softmax over the similarities to the classes
  return Loss(_known(TrainConfig, stored.get("train")).get("loss", Loss.softmax_xent))


def stored_objective(stored: dict) -> Objective:
  """What the checkpoint was trained for (a checkpoint without an objective: a classifier)."""
  return Objective(str((stored.get("objective") or {}).get("name") or "classification"))


def _sections(cfg: DictConfig, workdir: str, *names: str) -> dict:
  """The run fields every task shares (RunFields) and the task's own `names`, typed."""
  shared = {f.name: cfg[f.name] for f in dataclasses.fields(RunFields)}
  shared = {name: typed(value) if isinstance(value, (DictConfig, ListConfig)) else value
            for name, value in shared.items()}
  return {**shared, "workdir": str(workdir), **{name: typed(cfg[name]) for name in names}}


def eval_run(cfg: DictConfig, workdir: str, stored: dict) -> EvalRun:
  given = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
  model, data = stored_model_and_data(stored, given.get("model"), given.get("data"))
  contrastive = stored_objective(stored) == Objective.contrastive  # its towers, for zero-shot
  towers = {"objective": from_dict(ObjectiveConfig, _known(ObjectiveConfig, stored["objective"])),
            "text": from_dict(TextConfig, _known(TextConfig, stored.get("text")))
            } if contrastive else {}
  return EvalRun(model=model, data=data, loss=stored_loss(stored), **towers,
                 **_sections(cfg, workdir, "init", "eval"))


def _checkpoint_model_run(cls, cfg: DictConfig, workdir: str, stored: dict, *names: str):
  """`cls` (a CheckpointModelRun) of the stored model, data, loss and objective, with the
  command line's model.*, data.* and sections `names` on top."""
  given = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
  model, data = stored_model_and_data(stored, given.get("model"), given.get("data"))
  objective = from_dict(ObjectiveConfig, _known(ObjectiveConfig, stored.get("objective")))
  return cls(model=model, data=data, loss=stored_loss(stored), objective=objective,
             **_sections(cfg, workdir, *names))


def export_run(cfg: DictConfig, workdir: str, stored: dict) -> ExportRun:
  return _checkpoint_model_run(ExportRun, cfg, workdir, stored, "init")


def compress_run(cfg: DictConfig, workdir: str, stored: dict) -> CompressRun:
  return _checkpoint_model_run(CompressRun, cfg, workdir, stored, "init", "compress")


def checkpoint_paths(value, command: str = "fewshot") -> list[str]:
  """init.checkpoint as a list of paths: one workdir, or a list of them."""
  paths = [value] if isinstance(value, str) else list(value or [])
  paths = [str(p) for p in paths if p is not None and str(p).strip()]
  if not paths:
    what = ("to concatenate their pre-logit features" if command == "fewshot"
            else "to average their predictions")
    raise ConfigError(f"vmoe {command} needs init.checkpoint=<workdir of a pretrain/finetune run>, "
                      f"or a list of them, init.checkpoint=[runs/a,runs/b], {what}.")
  return paths


def fewshot_run(cfg: DictConfig, workdir: str, stored: dict[str, dict]) -> FewshotRun:
  """`stored`: checkpoint path -> its stored config, in the order of init.checkpoint."""
  given = OmegaConf.to_container(cfg.model, resolve=False, enum_to_str=True)
  members = []
  for path, config in stored.items():
    model, data = stored_model_and_data(config, given)
    members.append(FewshotMember(path=path, model=model, data=data,
                                 objective=stored_objective(config)))
  return FewshotRun(members=members, data=members[0].data, **_sections(cfg, workdir, "fewshot"))


def ensemble_run(cfg: DictConfig, workdir: str, stored: dict[str, dict]) -> EnsembleRun:
  """`stored`: checkpoint path -> its stored config, in the order of init.checkpoint."""
  given = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
  members = []
  for path, config in stored.items():
    model, data = stored_model_and_data(config, given.get("model"), given.get("data"))
    init = _known(InitConfig, config.get("init"))
    members.append(EnsembleMember(path=path, model=model, data=data, loss=stored_loss(config),
                                  stage=config.get("stage"), upstream=init.get("checkpoint"),
                                  seed=config.get("seed"), objective=stored_objective(config)))
  return EnsembleRun(members=members, data=members[0].data, loss=members[0].loss,
                     **_sections(cfg, workdir, "eval", "ensemble"))


def released_config(path: str, cfg: DictConfig, task: str,
                    checkpoints: CheckpointReader) -> dict:
  """What stands for the stored config of a released checkpoint, which carries bare parameters:
  the given model and data."""
  given = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
  model, data = _prune_none(given.get("model") or {}), _prune_none(given.get("data") or {})
  # Few-shot reads its own datasets; an export needs only the preprocessing, the default one.
  needs_data = subcommands.get(task).released_needs_data
  missing = [k for k, v in (("model", model), ("data", data if needs_data else {"name": 1}))
             if not v.get("name")]
  if missing:
    example = "model=vmoe_s32_last2" + (" data=imagenet2012" if needs_data else "")
    raise ConfigError(
        f"init.checkpoint={path} is {checkpoints.describe(path)}, which stores parameters only, no "
        f"config: vmoe {task} needs {' and '.join(f'{m}=' for m in missing)} for it (e.g. "
        f"{example}: the model whose parameters these are"
        + (", and the dataset its head predicts)." if needs_data else ")."))
  if not needs_data:
    datasets = (given.get("fewshot") or {}).get("datasets") or [data.get("name") or "released"]
    data = {"pp": f"decode(3)|resize({model.get('image_size', 224)})|value_range(-1,1)",
            **data, "name": str(datasets[0]).split(":")[0]}
  return {"model": model, "data": data, "stage": "released"}


def _stored(path: str, cfg: DictConfig, task: str, checkpoints: CheckpointReader | None) -> dict:
  if checkpoints is None:
    raise ValueError(f"the config of vmoe {task} comes from its checkpoints: load it with "
                     "checkpoints=runner.checkpoints.weights.Checkpoints() (or another CheckpointReader)")
  stored = checkpoints.stored_config(path)
  return released_config(path, cfg, task, checkpoints) if stored is None else stored


def load(task: str, cfg: DictConfig, workdir: str | None = None, *, check: bool = True,
         checkpoints: CheckpointReader | None = None):
  """The typed config of subcommand `task`, validated unless `check` is off (a job validates
  once, against its devices, when it starts). eval, fewshot and ensemble read their checkpoints'
  stored configs with `checkpoints` (runner.checkpoints.weights.Checkpoints)."""
  # Typing a composed config is a use of the schema: in a job's own process (SLURM's), after its
  # plug-ins have loaded, nothing has made it yet.
  sections.build()
  if workdir is None:
    workdir = "" if OmegaConf.is_missing(cfg, "workdir") else str(cfg.workdir)
  checked = validate if check else (lambda config: config)
  subcommand = subcommands.get(task)
  make = globals()[subcommand.resolver]  # one of this module's functions, named by the record
  if subcommand.reads == "checkpoint":
    path = cfg.init.checkpoint
    if not path:
      raise ConfigError(f"vmoe {task} needs init.checkpoint=<workdir of a pretrain/finetune run, "
                        "or a released checkpoint with its model= keys>.")
    return checked(make(cfg, workdir, _stored(path, cfg, task, checkpoints)))
  if subcommand.reads == "checkpoints":
    paths = checkpoint_paths(OmegaConf.to_container(cfg.init, resolve=True)["checkpoint"], task)
    stored = {p: _stored(p, cfg, task, checkpoints) for p in paths}
    if len(stored) != len(paths):
      raise ConfigError(f"init.checkpoint={paths} names a checkpoint twice.")
    return checked(make(cfg, workdir, stored))
  return checked(make(cfg, workdir))
