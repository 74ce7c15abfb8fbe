"""The splits a run reads from its dataset: the dataset opened, its splits checked, and a missing
eval split made a held-out slice of the train split."""
from __future__ import annotations

import dataclasses

from runner.config.schema import DataConfig
from runner.data.sources import DataError, Source, open_source


def open_data(d: DataConfig) -> tuple[DataConfig, Source]:
  """Opens the dataset; a missing eval split becomes a held-out slice of the train split. Returns
  the data config with the splits actually used, so they are stored with the checkpoint."""
  source = open_source(d.name, data_dir=d.data_dir, root=d.root, image_key=d.image_key,
                       label_key=d.label_key, skip_unreadable=d.skip_unreadable,
                       text_key=d.text_key)
  source.num_examples(d.split)  # raises with the valid splits
  if d.label_noise and source.multilabel:
    raise DataError(f"data.label_noise={d.label_noise} replaces a label by a random class, "
                    f"but dataset {d.name!r} is multi-label; use a single-label dataset.")
  split, eval_split, test_split = d.split, d.eval_split, d.test_split
  if not source.has_split(eval_split):
    if split not in source.splits:
      raise DataError(f"dataset {d.name!r} has no split {eval_split!r}; set "
                      f"data.eval_split to one of {sorted(source.splits)} or a slice.")
    n = source.num_examples(split)
    held = min(n - 1, max(1, round(n * d.holdout_fraction)))
    split, eval_split = f"{split}[:{n - held}]", f"{split}[{n - held}:]"
  if test_split and not source.has_split(test_split):
    test_split = None
  return dataclasses.replace(d, split=split, eval_split=eval_split, test_split=test_split), source
