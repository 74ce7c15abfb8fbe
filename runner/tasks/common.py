"""Steps every task takes: a plain resolved config, data opened with its splits, a checked model."""
from __future__ import annotations

import pathlib

import jax
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from runner import checkpoint, data, parallel
from runner.config import validate
from runner.errors import ConfigError
from runner.models import build_model, transfer
from runner.tasks import fewshot_data
from runner.train import state as state_lib
from runner.train.loop import train_and_evaluate


def plain_config(cfg: DictConfig, workdir: str) -> dict:
  """The resolved config as plain Python (enums as strings), with the real workdir."""
  try:
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True,
                                    throw_on_missing=True)
  except MissingMandatoryValue as e:
    raise ConfigError(f"{e.full_key} has no value and needs one: add {e.full_key}=<value> "
                      "(for data=image_folder: data.root=<dir with train/ and test/>).") from None
  except InterpolationResolutionError as e:
    raise ConfigError(f"cannot resolve {e.full_key}: {str(e).splitlines()[0]}") from None
  config["workdir"] = str(workdir)
  return config


def write_config(config: dict, workdir: str) -> None:
  if jax.process_index():
    return  # one writer for the shared workdir
  path = pathlib.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def open_data(d: dict) -> data.Source:
  """Opens the dataset; a missing eval split becomes a held-out slice of the train split.

  Updates `d` in place with the splits actually used, so they are stored with the checkpoint.
  """
  source = data.open_source(d["name"], data_dir=d.get("data_dir"), root=d.get("root"),
                            image_key=d.get("image_key", "image"),
                            label_key=d.get("label_key", "label"))
  source.num_examples(d["split"])  # raises with the valid splits
  if not source.has_split(d["eval_split"]):
    if d["split"] not in source.splits:
      raise data.DataError(f"dataset {d['name']!r} has no split {d['eval_split']!r}; set "
                           f"data.eval_split to one of {sorted(source.splits)} or a slice.")
    n = source.num_examples(d["split"])
    held = min(n - 1, max(1, round(n * d.get("holdout_fraction", 0.02))))
    d["split"], d["eval_split"] = f"{d['split']}[:{n - held}]", f"{d['split']}[{n - held}:]"
  if d.get("test_split") and not source.has_split(d["test_split"]):
    d["test_split"] = None
  return source


def num_experts(model_cfg: dict) -> int:
  moe = model_cfg.get("moe") or {}
  return int(moe.get("num_experts") or 0) if moe.get("layers") else 0


def make_placement(config: dict) -> parallel.Placement:
  """The mesh and sharding rules of the config, checked against the devices and the model."""
  return parallel.placement(config.get("mesh"), config.get("sharding"),
                            num_experts=num_experts(config["model"]))


def check_training(config: dict) -> None:
  """Everything about a training config that can be checked before touching data."""
  validate.check_model(config["model"])
  validate.check_optim(config["optim"])
  t = config["train"]
  if not t.get("steps") and not t.get("epochs"):
    raise ConfigError("set the training duration: train.steps=<n> or train.epochs=<x>.")
  validate.check_batch(config["data"]["batch_size"], config["model"],
                       accum_steps=t.get("accum_steps", 1))
  eval_batch = config["eval"].get("batch_size") or config["data"].get("eval_batch_size")
  if eval_batch:
    validate.check_batch(eval_batch, config["model"], what="eval.batch_size")
  if fewshot_data.enabled_in_training(config):
    fewshot_data.check_config(config["fewshot"])
    validate.check_batch(fewshot_data.batch_size(config["fewshot"], config["data"], eval_batch),
                         config["model"], what="fewshot.batch_size")


def build_checked_model(model_cfg: dict, num_classes: int):
  validate.check_model(model_cfg)
  return build_model(model_cfg, num_classes)


def is_resuming(workdir: str) -> bool:
  return any(pathlib.Path(workdir, "checkpoints").glob("[0-9]*/params"))


def check_init_path(config: dict, workdir: str) -> None:
  """Fails fast on a wrong init.checkpoint path (ignored when the workdir resumes)."""
  if config["init"].get("checkpoint") and not is_resuming(workdir):
    checkpoint.locate(config["init"]["checkpoint"])


def init_from_checkpoint(config: dict, model, source: data.Source, workdir: str):
  """Parameters for `model` mapped from init.checkpoint, or None (scratch, or resuming)."""
  init = config["init"]
  if not init.get("checkpoint") or is_resuming(workdir):
    return None
  restored, stored, step = checkpoint.load_params(init["checkpoint"])
  d = config["data"]
  fresh, _ = state_lib.init_params(model, data.image_shape(source, d["split"], d["pp_train"]),
                                   config["seed"])
  try:
    return transfer.adapt_params(restored, fresh, reinit_head=init["reinit_head"],
                                 dense_to_experts=init["dense_to_experts"],
                                 source=f"checkpoint {init['checkpoint']} (step {step})")
  except checkpoint.CheckpointError as e:
    diff = _model_differences(stored.get("model", {}), config["model"])
    raise checkpoint.CheckpointError(
        f"{e} The checkpoint was trained with model={stored.get('model', {}).get('name')}"
        + (f", which differs from this one in {diff}" if diff else "")
        + "; pass the same model (and model.* overrides) as that run.") from None


def _model_differences(stored: dict, current: dict, prefix: str = "model.") -> str:
  """'model.hidden_size 32 -> 48, ...' for the architecture keys that differ."""
  ignore = {"name", "dropout_rate", "attention_dropout_rate", "dtype", "router", "image_size"}
  out = []
  for key in sorted(set(stored) | set(current)):
    if key in ignore or key in ("expert_dropout", "dispatcher", "group_size"):
      continue
    a, b = stored.get(key), current.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      sub = _model_differences(a, b, f"{prefix}{key}.")
      out += [sub] if sub else []
    elif a != b:
      out.append(f"{prefix}{key} {a} -> {b}")
  return ", ".join(out)


def run_training(cfg, workdir: str, stage: str) -> dict:
  """pretrain and finetune: the same steps; their configs differ (data, optimizer, head)."""
  config = plain_config(cfg, workdir)
  parallel.initialize(config.get("distributed"))
  placement = make_placement(config)
  check_training(config)
  check_init_path(config, workdir)
  source = open_data(config["data"])
  fewshot = None
  if fewshot_data.enabled_in_training(config):  # every dataset checked before any compute
    fewshot_cfg = config["fewshot"]
    eval_batch = config["eval"].get("batch_size")
    fewshot = fewshot_data.batches(fewshot_data.open_datasets(fewshot_cfg, config["data"]),
                                   fewshot_data.batch_size(fewshot_cfg, config["data"], eval_batch))
  model = build_checked_model(config["model"], source.num_classes)
  init_params = init_from_checkpoint(config, model, source, workdir)
  write_config(config, workdir)
  return train_and_evaluate(config, model=model, source=source, placement=placement,
                            workdir=workdir, init_params=init_params, stage=stage,
                            fewshot_datasets=fewshot)
