"""data=image_folder (tfds.folder_dataset.ImageFolder behind open_source) and open_data's hold-out.

Every image in the test folder is one solid colour, unique per file, so a decoded and resized
image still says which file (and so which class) it came from.
"""
from __future__ import annotations

import collections
import os
import pathlib

import numpy as np
import pytest
from PIL import Image

from runner import data
from runner.data import DataError
from runner.tasks.common import open_data

CLASSES = ["cat", "dog", "fish"]
SPEC = "decode(3)|resize(16)|value_range(-1, 1)"


def _colour(split: str, cls: int, i: int) -> tuple[int, int, int]:
  """Distinct, well separated colours: (class, index, split) coded in the three channels."""
  return (40 + 70 * cls, 20 + 20 * i, 60 if split == "train" else 200)


def _files(split: str, n_per_class: int):
  """(class index, file name, PIL mode, size, format) for every image of a split."""
  modes = [("RGB", "PNG"), ("L", "PNG"), ("RGBA", "PNG"), ("RGB", "JPEG"), ("RGB", "PNG")]
  out = []
  for c in range(len(CLASSES)):
    for i in range(n_per_class):
      mode, fmt = modes[(i + c) % len(modes)]
      size = (5 + 3 * i, 9 + 2 * c)  # (width, height): every image a different size
      ext = {"PNG": "png", "JPEG": "jpg"}[fmt]
      out.append((c, i, f"img{i}.{ext}", mode, size, fmt))
  return out


def _write(root: pathlib.Path, split: str, n_per_class: int) -> dict[tuple, int]:
  """Writes the split; returns {expected RGB colour: class index}."""
  want = {}
  for c, i, name, mode, size, fmt in _files(split, n_per_class):
    rgb = _colour(split, c, i)
    folder = root / split / CLASSES[c]
    folder.mkdir(parents=True, exist_ok=True)
    if mode == "L":
      grey = rgb[0]
      Image.new("L", size, grey).save(folder / name, format=fmt)
      rgb = (grey, grey, grey)
    elif mode == "RGBA":
      Image.new("RGBA", size, rgb + (128,)).save(folder / name, format=fmt)
    else:
      Image.new("RGB", size, rgb).save(folder / name, format=fmt)
    want[rgb] = c
  assert len(want) == len(_files(split, n_per_class)), "colours must be unique within a split"
  return want


N_TRAIN, N_TEST = 5, 2  # per class


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  root = tmp_path_factory.mktemp("images")
  want = {"train": _write(root, "train", N_TRAIN), "test": _write(root, "test", N_TEST)}
  (root / "train" / "README.txt").write_text("not an image")
  (root / "train" / "dog" / "notes.txt").write_text("not an image either")
  return root, want


@pytest.fixture(scope="module")
def source(folder):
  return data.open_source("image_folder", root=str(folder[0]))


def _colours(images: np.ndarray) -> list[tuple[int, int, int]]:
  """Each image's (single) colour, checking that it is uniform, back in 0..255."""
  out = []
  for image in images:
    px = (image.reshape(-1, 3) + 1) * 127.5
    assert np.ptp(px, axis=0).max() <= 6, "image is not one solid colour"
    out.append(tuple(int(round(v)) for v in px.mean(axis=0)))
  return out


def _match(colour, want: dict, tol: int) -> int:
  """The class of the expected colour within `tol` (JPEG is lossy) of `colour`."""
  hits = [c for rgb, c in want.items() if max(abs(a - b) for a, b in zip(rgb, colour)) <= tol]
  assert len(hits) == 1, (colour, hits)
  return hits[0]


def test_classes_and_splits(source):
  assert source.name == "image_folder"
  assert source.num_classes == 3 and not source.multilabel
  assert source.builder.info.features["label"].names == CLASSES
  assert source.splits == {"train": 3 * N_TRAIN, "test": 3 * N_TEST}
  assert source.num_examples("train[:60%]") == 9 and source.num_examples("train[-4:]") == 4


def test_eval_batches_decode_resize_and_label(source, folder):
  _, want = folder
  got = list(data.eval_batches(source, "train", SPEC, 4).as_numpy_iterator())
  assert len(got) == 4
  images = np.concatenate([b["image"] for b in got])
  labels = np.concatenate([b["labels"] for b in got])
  mask = np.concatenate([b["_mask"] for b in got])
  assert images.shape == (16, 16, 16, 3) and images.dtype == np.float32
  assert mask.sum() == 15 and not mask[-1]
  real = images[mask]
  assert real.min() >= -1 and real.max() <= 1
  classes = [_match(c, want["train"], tol=6) for c in _colours(real)]
  assert sorted(classes) == sorted(want["train"].values())  # each file once, with its label
  np.testing.assert_array_equal(labels[mask], np.eye(3)[classes])


def test_train_batches_and_image_shape(source, folder):
  _, want = folder
  assert data.image_shape(source, "train", SPEC) == (16, 16, 3)
  stream = data.train_batches(source, "test", SPEC, 6, seed=1)
  batch = next(stream)
  assert batch["image"].shape == (6, 16, 16, 3)
  classes = [_match(c, want["test"], tol=6) for c in _colours(batch["image"])]
  np.testing.assert_array_equal(batch["labels"], np.eye(3)[classes])
  assert sorted(classes) == sorted(want["test"].values())  # the whole test split, once


def _filenames(source, split) -> list[str]:
  return [ex["image/filename"].decode() for ex in source.read(split).as_numpy_iterator()]


def test_read_slices_follow_one_fixed_order(source):
  full = _filenames(source, "train")
  assert len(full) == len(set(full)) == 15
  assert _filenames(source, "train[:10]") == full[:10]
  assert _filenames(source, "train[10:]") == full[10:]
  assert _filenames(source, "train[-20%:]") == full[-3:]
  reopened = data.open_source("image_folder", root=source.builder.data_dir)
  assert _filenames(reopened, "train") == full
  assert _filenames(source, "train[:40%]") == full[:6]
  shares = [[ex["image/filename"].decode()
             for ex in source.read("train", i, 2).as_numpy_iterator()] for i in range(2)]
  assert shares == [full[:7], full[7:14]]


def _config(root, **kw) -> dict:
  d = {"name": "image_folder", "split": "train", "eval_split": "validation", "test_split": "test",
       "holdout_fraction": 0.2, "root": str(root), "data_dir": None, "image_key": "image",
       "label_key": "label"}
  d.update(kw)
  return d


@pytest.mark.parametrize("fraction,n_eval", [(0.2, 3), (0.4, 6), (0.1, 2), (0.5, 8)])
def test_open_data_holds_out_part_of_train(source, folder, fraction, n_eval):
  d = _config(folder[0], holdout_fraction=fraction)
  opened = open_data(d)
  kept = 15 - n_eval
  assert d["split"] == f"train[:{kept}]" and d["eval_split"] == f"train[{kept}:]"
  assert d["test_split"] == "test"
  assert opened.num_examples(d["eval_split"]) == n_eval
  assert opened.num_examples(d["split"]) + opened.num_examples(d["eval_split"]) == 15
  train, held = _filenames(opened, d["split"]), _filenames(opened, d["eval_split"])
  assert not set(train) & set(held) and len(set(train) | set(held)) == 15


def test_open_data_keeps_an_existing_eval_split_and_drops_a_missing_test_split(folder):
  d = _config(folder[0], eval_split="test", test_split="nonexistent")
  open_data(d)
  assert (d["split"], d["eval_split"], d["test_split"]) == ("train", "test", None)
  d = _config(folder[0], split="train[:10]", eval_split="train[10:]")
  open_data(d)
  assert (d["split"], d["eval_split"]) == ("train[:10]", "train[10:]")


def test_open_data_errors(folder):
  with pytest.raises(DataError, match="train"):
    open_data(_config(folder[0], split="training"))
  with pytest.raises(DataError, match="data.eval_split"):
    open_data(_config(folder[0], split="train[:50%]"))


def test_open_data_holdout_is_never_empty(tmp_path):
  for i in range(20):
    folder = tmp_path / "train" / f"c{i % 2}"
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (i, i, i)).save(folder / f"{i}.png")
  d = _config(tmp_path, holdout_fraction=0.02)
  source = open_data(d)
  assert source.num_examples(d["eval_split"]) > 0


def test_missing_root(tmp_path):
  with pytest.raises(DataError, match=r"data\.root=<dir>.*train/ and test/"):
    data.open_source("image_folder")
  with pytest.raises(DataError, match="does not exist"):
    data.open_source("image_folder", root=str(tmp_path / "nowhere"))


def test_root_without_train_folder_lists_what_it_holds(tmp_path):
  (tmp_path / "training").mkdir()
  (tmp_path / "test").mkdir()
  with pytest.raises(DataError) as e:
    data.open_source("image_folder", root=str(tmp_path))
  msg = str(e.value)
  assert "must contain a train/ folder" in msg and "['test', 'training']" in msg


def test_root_is_expanded(folder, monkeypatch):
  root, _ = folder
  monkeypatch.setenv("HOME", str(root.parent))
  source = data.open_source("image_folder", root=os.path.join("~", root.name))
  assert source.splits["train"] == 15


def test_train_folder_without_images(tmp_path):
  (tmp_path / "train" / "cat").mkdir(parents=True)
  (tmp_path / "train" / "cat" / "a.txt").write_text("x")
  with pytest.raises(DataError, match="has no images"):
    data.open_source("image_folder", root=str(tmp_path))


def test_train_folder_without_class_folders(tmp_path):
  (tmp_path / "train").mkdir()
  Image.new("RGB", (4, 4)).save(tmp_path / "train" / "loose.png")
  with pytest.raises(DataError):
    data.open_source("image_folder", root=str(tmp_path))


def test_no_images_message_names_the_formats_actually_read(tmp_path):
  folder = tmp_path / "train" / "cat"
  folder.mkdir(parents=True)
  Image.new("RGB", (4, 4)).save(folder / "a.gif")
  Image.new("RGB", (4, 4)).save(folder / "b.bmp")
  with pytest.raises(DataError) as e:  # the .gif/.bmp files are not read at all
    data.open_source("image_folder", root=str(tmp_path))
  assert ".gif" not in str(e.value) and ".bmp" not in str(e.value)


def test_label_counts(source):
  counts = collections.Counter(int(ex["label"]) for ex in source.read("train").as_numpy_iterator())
  assert counts == {0: N_TRAIN, 1: N_TRAIN, 2: N_TRAIN}
