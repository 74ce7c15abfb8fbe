"""Steps every task takes: a plain resolved config, data opened with its splits, a checked model."""
from __future__ import annotations

import pathlib

import yaml
from omegaconf import DictConfig, OmegaConf

from runner import data
from runner.config import validate
from runner.errors import ConfigError
from runner.models import build_model


def plain_config(cfg: DictConfig, workdir: str) -> dict:
  """The resolved config as plain Python (enums as strings), with the real workdir."""
  config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
  config["workdir"] = str(workdir)
  return config


def write_config(config: dict, workdir: str) -> None:
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
    pct = round(100 * (1 - d.get("holdout_fraction", 0.02)))
    d["split"], d["eval_split"] = f"{d['split']}[:{pct}%]", f"{d['split']}[{pct}%:]"
  if d.get("test_split") and not source.has_split(d["test_split"]):
    d["test_split"] = None
  return source


def check_training(config: dict) -> None:
  """Everything about a training config that can be checked before touching data."""
  validate.check_model(config["model"])
  t = config["train"]
  if not t.get("steps") and not t.get("epochs"):
    raise ConfigError("set the training duration: train.steps=<n> or train.epochs=<x>.")
  validate.check_batch(config["data"]["batch_size"], config["model"],
                       accum_steps=t.get("accum_steps", 1))
  eval_batch = config["eval"].get("batch_size") or config["data"].get("eval_batch_size")
  if eval_batch:
    validate.check_batch(eval_batch, config["model"], what="eval.batch_size")


def build_checked_model(model_cfg: dict, num_classes: int):
  validate.check_model(model_cfg)
  return build_model(model_cfg, num_classes)
