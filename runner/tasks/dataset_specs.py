"""A dataset named on the command line (eval.datasets, fewshot.datasets) as a full data config.

The evaluated model fixes the preprocessing (its image size and value range), so every dataset is
read with the checkpoint's eval `pp`; only the splits and keys depend on the dataset: from its
`conf/data/<name>.yaml` when there is one, else TFDS's usual train/validation/test.
"""
from __future__ import annotations

import copy

from omegaconf import OmegaConf

from runner.config import conf_dir

_SPLIT_KEYS = ("split", "eval_split", "test_split", "holdout_fraction", "image_key", "label_key")


def dataset_config(name: str, base: dict) -> dict:
  """The data config for dataset `name`, evaluated like `base` (the checkpoint's data config).

  `name` may carry a split, "cifar10:test" or "uci_digits:validation[:50%]", which becomes the
  test split. The checkpoint's own dataset keeps its stored splits.
  """
  name, _, split = name.partition(":")
  if name == base.get("name"):
    config = copy.deepcopy(base)
  else:
    config = {k: base[k] for k in ("pp", "batch_size", "eval_batch_size", "data_dir") if k in base}
    config.update({"name": name, "split": "train", "eval_split": "validation",
                   "test_split": "test", "holdout_fraction": base.get("holdout_fraction", 0.02)})
    known = conf_dir() / "data" / f"{name}.yaml"
    if known.exists():
      own = OmegaConf.to_container(OmegaConf.load(known), resolve=False)
      config.update({k: own[k] for k in _SPLIT_KEYS if k in own and own[k] is not None})
  if split:
    config["test_split"] = split
  config["pp"] = base["pp"]
  return config
