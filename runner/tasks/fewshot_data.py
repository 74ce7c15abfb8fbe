"""Few-shot datasets named on the command line (fewshot.datasets): pools, test splits, checks.

Shared by `vmoe fewshot` and by training with fewshot.every_steps. Every problem (unknown
dataset or split, an empty split, a class with fewer examples than the shots asked) is found here,
from split sizes and the label column alone, before a model is compiled or an image decoded.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from runner import data
from runner.errors import ConfigError
from runner.evaluators.fewshot_math import FewShotError
from runner.tasks import common
from runner.tasks.dataset_specs import dataset_config


@dataclasses.dataclass
class FewshotData:
  """One opened few-shot dataset: where its shots come from and what it is tested on."""
  name: str
  source: data.Source
  config: dict  # the dataset's data config, read with the evaluated model's preprocessing
  train_split: str  # the pool the shots are drawn from
  test_split: str
  num_train: int
  num_test: int
  class_counts: np.ndarray  # examples per class in the pool


def enabled_in_training(config: dict) -> bool:
  fewshot = config.get("fewshot") or {}
  return int(fewshot.get("every_steps") or 0) > 0 and bool(fewshot.get("datasets"))


def check_config(fewshot: dict) -> None:
  """The fewshot.* values that make sense on their own: shots, seeds, L2 grid, caps."""
  if not fewshot.get("datasets"):
    embedded = ", ".join(n for n in data.known_names() if n != "image_folder")
    raise ConfigError("fewshot.datasets is empty: name the datasets to evaluate, e.g. "
                      f"fewshot.datasets=[uci_digits,mnist5k] (embedded: {embedded}; or any "
                      "prepared TFDS dataset; 'name:split' picks the test split).")
  shots = fewshot.get("shots") or []
  if not shots or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shots):
    raise ConfigError(f"fewshot.shots={shots} must be a non-empty list of positive integers "
                      "(examples per class), e.g. fewshot.shots=[1,5,10,25].")
  seeds = fewshot.get("seeds") or []
  if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
    raise ConfigError(f"fewshot.seeds={seeds} must be a non-empty list of integers, e.g. "
                      "fewshot.seeds=[0,1,2] (accuracies are averaged over them).")
  regs = fewshot.get("l2_regs")
  if regs is not None:
    values = np.asarray(regs, np.float64) if all(
        isinstance(r, (int, float)) and not isinstance(r, bool) for r in regs) else None
    if values is None or values.ndim != 1 or not len(values) or np.any(values <= 0) or np.any(
        np.diff(values) <= 0):
      raise ConfigError(f"fewshot.l2_regs={regs} must be positive and strictly ascending, e.g. "
                        "fewshot.l2_regs=[0.1,1,10,100]; null uses the grid 2^-10 ... 2^19.")
  cap = fewshot.get("max_train_examples")
  if cap is not None and cap < 1:
    raise ConfigError(f"fewshot.max_train_examples={cap} must be >= 1 (null: the whole pool).")
  if fewshot.get("batch_size") is not None and fewshot["batch_size"] < 1:
    raise ConfigError(f"fewshot.batch_size={fewshot['batch_size']} must be >= 1.")


def label_counts(source: data.Source, split: str) -> np.ndarray:
  """Examples per class in `split`, from the label column only (images stay encoded)."""
  key = source.label_key
  ds = source.read(split, drop_remainder=False).map(lambda example: example[key]).batch(8192)
  counts = np.zeros(source.num_classes, np.int64)
  for labels in ds.as_numpy_iterator():
    counts += np.bincount(np.asarray(labels, np.int64), minlength=source.num_classes)
  return counts


def pool_split(d: dict, train_split: str) -> str:
  """fewshot.train_split; when that is the default 'train' and the dataset's own config trains on
  a slice of it (train[:98%], the rest held out for validation), that slice."""
  own = str(d.get("split") or "")
  if train_split == "train" and own.replace(" ", "").startswith("train["):
    return own
  return train_split


def _nonempty(source: data.Source, split: str, what: str) -> int:
  n = source.num_examples(split)  # DataError naming the valid splits
  if n < 1:
    raise data.DataError(f"{what} {split!r} of dataset {source.name!r} has no examples; its splits "
                         f"are {', '.join(f'{k} ({v})' for k, v in source.splits.items())}.")
  return n


def open_dataset(spec: str, base_data: dict, fewshot: dict) -> FewshotData:
  """Opens dataset `spec` ('name' or 'name:test_split') and checks it can give max(shots)."""
  explicit_test = spec.partition(":")[2]
  d = dataset_config(spec, base_data)
  source = common.open_data(d)
  if source.multilabel:
    raise data.DataError(f"few-shot dataset {spec!r} is multi-label; linear few-shot evaluation "
                         "needs one class per image. Choose a single-label dataset.")
  train = pool_split(d, fewshot.get("train_split") or "train")
  num_train = _nonempty(source, train, "the few-shot pool (fewshot.train_split)")
  cap = fewshot.get("max_train_examples")
  if cap is not None and cap < num_train:
    train, num_train = source.head(train, int(cap)), int(cap)
  test = explicit_test or fewshot.get("test_split") or d.get("test_split") or d["eval_split"]
  num_test = _nonempty(source, test, "the few-shot test split")
  counts = label_counts(source, train)
  most = max(fewshot["shots"])
  short = np.flatnonzero(counts < most)
  if len(short):
    c = int(short[np.argmin(counts[short])])
    others = len(short) - 1
    more = f" ({others} more class{'es' if others > 1 else ''} too)" if others else ""
    fewer = f"at most {int(counts.min())} shots, " if counts.min() >= 1 else ""
    raise FewShotError(
        f"few-shot dataset {spec!r}: class {c} has {counts[c]} examples in the pool {train!r} "
        f"({num_train} examples), fewer than the {most} shots asked by fewshot.shots="
        f"{list(fewshot['shots'])}{more}; use {fewer}a larger pool (fewshot.train_split, "
        "fewshot.max_train_examples) or another dataset.")
  return FewshotData(name=spec, source=source, config=d, train_split=train, test_split=test,
                     num_train=num_train, num_test=num_test, class_counts=counts)


def open_datasets(fewshot: dict, base_data: dict) -> dict[str, FewshotData]:
  """Every dataset of fewshot.datasets, checked, read with `base_data`'s preprocessing (pp)."""
  check_config(fewshot)
  names = [str(n) for n in fewshot["datasets"]]
  if len(set(names)) != len(names):
    raise ConfigError(f"fewshot.datasets={names} names a dataset twice.")
  return {name: open_dataset(name, base_data, fewshot) for name in names}


def batches(opened: dict[str, FewshotData], batch_size: int, *,
            cache: bool = True) -> dict[str, tuple]:
  """name -> (pool batches, test batches, num_classes), as FewshotEvaluator takes them.

  `cache` keeps small splits in memory for the repeated evaluations of training.
  """
  processes = dict(process_index=jax.process_index(), process_count=jax.process_count())
  per_process = batch_size // processes["process_count"]
  out = {}
  for name, f in opened.items():
    pp = f.config["pp"]
    out[name] = tuple(data.eval_batches(f.source, split, pp, per_process, cache=cache, **processes)
                      for split in (f.train_split, f.test_split)) + (f.source.num_classes,)
  return out


def batch_size(fewshot: dict, data_cfg: dict, eval_batch_size: int | None = None) -> int:
  """fewshot.batch_size, else the evaluation batch size, else the data's batch size."""
  return int(fewshot.get("batch_size") or eval_batch_size or data_cfg.get("eval_batch_size")
             or data_cfg["batch_size"])
