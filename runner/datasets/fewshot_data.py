"""Few-shot datasets named on the command line (fewshot.datasets): pools, test splits, checks.

Shared by `vmoe fewshot` and training with fewshot.every_steps. Every problem (unknown dataset or
split, an empty split, a class with fewer examples than the shots asked) is found here, from split
sizes and the label column alone, before a model is compiled or an image decoded."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from runner import data
from runner.config.schema import DataConfig, FewshotConfig
from runner.errors import FewShotError
from runner.datasets.dataset_specs import dataset_config


@dataclasses.dataclass
class FewshotData:
  """One opened few-shot dataset: where its shots come from and what it is tested on."""
  name: str
  source: data.Source
  config: DataConfig  # the dataset's data config, read with the evaluated model's preprocessing
  train_split: str  # the pool the shots are drawn from
  test_split: str
  num_train: int
  num_test: int
  class_counts: np.ndarray  # examples per class in the pool


def label_counts(source: data.Source, split: str) -> np.ndarray:
  """Examples per class in `split`, from the label column only (images stay encoded)."""
  key = source.label_key
  ds = source.read(split, drop_remainder=False).map(lambda example: example[key]).batch(8192)
  counts = np.zeros(source.num_classes, np.int64)
  for labels in ds.as_numpy_iterator():
    counts += np.bincount(np.asarray(labels, np.int64), minlength=source.num_classes)
  return counts


def pool_split(d: DataConfig, train_split: str) -> str:
  """fewshot.train_split; when that is the default 'train' and the dataset's own config trains on
  a slice of it (train[:98%], the rest held out for validation), that slice."""
  own = str(d.split or "")
  own_slice = train_split == "train" and own.replace(" ", "").startswith("train[")
  return own if own_slice else train_split


def _nonempty(source: data.Source, split: str, what: str) -> int:
  n = source.num_examples(split)  # DataError naming the valid splits
  if n < 1:
    raise data.DataError(f"{what} {split!r} of dataset {source.name!r} has no examples; its splits "
                         f"are {', '.join(f'{k} ({v})' for k, v in source.splits.items())}.")
  return n


def open_dataset(spec: str, base_data: DataConfig, fewshot: FewshotConfig) -> FewshotData:
  """Opens dataset `spec` ('name' or 'name:test_split') and checks it can give max(shots)."""
  explicit_test = spec.partition(":")[2]
  d, source = data.open_data(dataset_config(spec, base_data))
  if source.multilabel:
    raise data.DataError(f"few-shot dataset {spec!r} is multi-label; linear few-shot evaluation "
                         "needs one class per image. Choose a single-label dataset.")
  train = pool_split(d, fewshot.train_split or "train")
  num_train = _nonempty(source, train, "the few-shot pool (fewshot.train_split)")
  cap = fewshot.max_train_examples
  if cap is not None and cap < num_train:
    train, num_train = source.head(train, int(cap)), int(cap)
  test = explicit_test or fewshot.test_split or d.test_split or d.eval_split
  num_test = _nonempty(source, test, "the few-shot test split")
  counts = label_counts(source, train)
  most = max(fewshot.shots)
  short = np.flatnonzero(counts < most)
  if len(short):
    c = int(short[np.argmin(counts[short])])
    others = len(short) - 1
    more = f" ({others} more class{'es' if others > 1 else ''} too)" if others else ""
    fewer = f"at most {int(counts.min())} shots, " if counts.min() >= 1 else ""
    raise FewShotError(
        f"few-shot dataset {spec!r}: class {c} has {counts[c]} examples in the pool {train!r} "
        f"({num_train} examples), fewer than the {most} shots asked by fewshot.shots="
        f"{list(fewshot.shots)}{more}; use {fewer}a larger pool (fewshot.train_split, "
        "fewshot.max_train_examples) or another dataset.")
  return FewshotData(name=spec, source=source, config=d, train_split=train, test_split=test,
                     num_train=num_train, num_test=num_test, class_counts=counts)


def open_datasets(fewshot: FewshotConfig, base_data: DataConfig) -> dict[str, FewshotData]:
  """Every dataset of fewshot.datasets, checked, read with `base_data`'s preprocessing (pp)."""
  return {name: open_dataset(name, base_data, fewshot) for name in map(str, fewshot.datasets)}


def batches(opened: dict[str, FewshotData], batch_size: int, *,
            cache: bool | None = None) -> dict[str, tuple]:
  """name -> (pool batches, test batches, num_classes), as FewshotEvaluator takes them. `cache`
  (None) keeps small splits in memory for the repeated evaluations of training."""
  processes = dict(process_index=jax.process_index(), process_count=jax.process_count())
  per_process = batch_size // processes["process_count"]
  out = {}
  for name, f in opened.items():
    pp = f.config.pp
    out[name] = tuple(data.eval_batches(f.source, split, pp, per_process, cache=cache, **processes)
                      for split in (f.train_split, f.test_split)) + (f.source.num_classes,)
  return out
