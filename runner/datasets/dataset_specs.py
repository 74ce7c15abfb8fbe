"""A dataset named on the command line (eval.datasets, fewshot.datasets) as a full data config.

The evaluated model fixes the preprocessing (image size, value range): every dataset is read with
the checkpoint's eval `pp`; only its splits and keys are its own, from conf/data/<name>.yaml
(with its captions' `text_key`) where there is one, else TFDS's usual train/validation/test."""
from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from runner import data
from runner.config import conf_dir
from runner.config.schema import DataConfig
from runner.evaluators.suite import Dataset

_SPLIT_KEYS = ("split", "eval_split", "test_split", "holdout_fraction", "image_key", "label_key",
               "text_key")


def dataset_config(name: str, base: DataConfig) -> DataConfig:
  """The data config for dataset `name`, evaluated like `base` (the checkpoint's data config).
  `name` may carry a split, "cifar10:test" or "uci_digits:validation[:50%]", which becomes the
  test split. The checkpoint's own dataset keeps its stored splits."""
  name, _, split = name.partition(":")
  if name == base.name:
    config = base
  else:
    own = {"split": "train", "eval_split": "validation", "test_split": "test"}
    known = conf_dir() / "data" / f"{name}.yaml"
    if known.exists():
      loaded = OmegaConf.to_container(OmegaConf.load(known), resolve=False)
      own.update({k: loaded[k] for k in _SPLIT_KEYS if loaded.get(k) is not None})
    config = DataConfig(name=name, pp=base.pp, pp_train=base.pp, batch_size=base.batch_size,
                        eval_batch_size=base.eval_batch_size, data_dir=base.data_dir,
                        holdout_fraction=own.pop("holdout_fraction", base.holdout_fraction), **own)
  if split:
    config = dataclasses.replace(config, test_split=split)
  return dataclasses.replace(config, pp=base.pp)


def open_dataset(name: str, base: DataConfig, split: str | None,
                 role: str = "eval dataset") -> Dataset:
  """A dataset of eval.* (or `role`, e.g. compress's), opened, the split read checked non-empty."""
  config, source = data.open_data(dataset_config(name, base))
  split = split or config.test_split or config.eval_split
  try:
    n = source.num_examples(split)
  except data.DataError as e:
    raise data.DataError(f"{role} {name!r}: {e}") from None
  if n == 0:
    raise data.DataError(f"{role} {name!r}: split {split!r} is empty; choose a split "
                         f"with examples (available: {source.splits}).")
  return Dataset(name=name, config=config, source=source, split=split)
