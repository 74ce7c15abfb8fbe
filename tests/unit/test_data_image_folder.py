"""data=image_folder (runner.data.image_folder behind open_source) and open_data's hold-out.

Every image in the test folder is one solid colour, unique per file, so a decoded and resized
image still says which file (and so which class) it came from. The folder is scanned before use:
every fault (unreadable or stray files, empty or missing classes, empty splits) in one message.
"""
from __future__ import annotations

import collections
import io
import os
import pathlib

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from runner import data
from runner.config.schema import DataConfig
from runner.data import DataError
from runner.models import inputs
from runner.data import open_data

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
  (root / "train" / "README.txt").write_text("not an image")  # not in a class: ignored
  (root / "notes.txt").write_text("not an image either")  # not in a split: ignored
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
  assert all(b["image"].dtype == np.uint8 for b in got)  # value_range runs in the step
  images = np.concatenate([np.asarray(inputs.images(b)) for b in got])
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
  classes = [_match(c, want["test"], tol=6) for c in _colours(np.asarray(inputs.images(batch)))]
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


def _config(root, **kw) -> DataConfig:
  return DataConfig(**{"name": "image_folder", "holdout_fraction": 0.2, "root": str(root), **kw})


@pytest.mark.parametrize("fraction,n_eval", [(0.2, 3), (0.4, 6), (0.1, 2), (0.5, 8)])
def test_open_data_holds_out_part_of_train(source, folder, fraction, n_eval):
  d, opened = open_data(_config(folder[0], holdout_fraction=fraction))
  kept = 15 - n_eval
  assert d.split == f"train[:{kept}]" and d.eval_split == f"train[{kept}:]"
  assert d.test_split == "test"
  assert opened.num_examples(d.eval_split) == n_eval
  assert opened.num_examples(d.split) + opened.num_examples(d.eval_split) == 15
  train, held = _filenames(opened, d.split), _filenames(opened, d.eval_split)
  assert not set(train) & set(held) and len(set(train) | set(held)) == 15


def test_open_data_keeps_an_existing_eval_split_and_drops_a_missing_test_split(folder):
  d, _ = open_data(_config(folder[0], eval_split="test", test_split="nonexistent"))
  assert (d.split, d.eval_split, d.test_split) == ("train", "test", None)
  d, _ = open_data(_config(folder[0], split="train[:10]", eval_split="train[10:]"))
  assert (d.split, d.eval_split) == ("train[:10]", "train[10:]")


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
  d, source = open_data(_config(tmp_path, holdout_fraction=0.02))
  assert source.num_examples(d.eval_split) > 0


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
  msg = str(e.value)
  assert "train/cat/a.gif: not a .jpg/.jpeg/.png image" in msg
  assert "train/cat/b.bmp: not a .jpg/.jpeg/.png image" in msg
  assert "train/ has no images" in msg


def test_label_counts(source):
  counts = collections.Counter(int(ex["label"]) for ex in source.read("train").as_numpy_iterator())
  assert counts == {0: N_TRAIN, 1: N_TRAIN, 2: N_TRAIN}


def test_scanned_builder_keeps_tfds_labels_and_order(source, folder):
  """Same labels, splits and per-split record order as tfds' own ImageFolder on a clean folder."""
  theirs = tfds.folder_dataset.ImageFolder(str(folder[0]))
  assert isinstance(source.builder, tfds.folder_dataset.ImageFolder)
  assert source.builder.info.features["label"].names == theirs.info.features["label"].names
  assert list(source.builder.info.splits) == list(theirs.info.splits)
  for split in theirs.info.splits:
    assert ([tuple(e) for e in source.builder._split_examples[split]]
            == [tuple(e) for e in theirs._split_examples[split]])


# --- Faults: every one found in one scan and reported in one line. ---

def _png(path: pathlib.Path, colour=(10, 20, 30)) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  Image.new("RGB", (6, 5), colour).save(path, format="PNG")


def _encoded(fmt: str) -> bytes:
  """A valid image of noise (so the encoding is not tiny) in `fmt`."""
  noise = np.random.default_rng(0).integers(0, 256, (48, 48, 3), dtype=np.uint8)
  buffer = io.BytesIO()
  Image.fromarray(noise).save(buffer, format=fmt)
  return buffer.getvalue()


def _half(fmt: str) -> bytes:
  """The first half of a valid image: what an interrupted copy or download leaves."""
  whole = _encoded(fmt)
  return whole[:len(whole) // 2]


def _write_bytes(path: pathlib.Path, content: bytes) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(content)


def _clean(root: pathlib.Path, classes=("cat", "dog"), splits=("train", "test"), n=2) -> None:
  for split in splits:
    for c, cls in enumerate(classes):
      for i in range(n):
        _png(root / split / cls / f"ok{i}.png", (c, i, 9))


def _error(root: pathlib.Path, **kw) -> str:
  """The DataError message of opening root: one line that starts by naming data.root."""
  with pytest.raises(DataError) as e:
    data.open_source("image_folder", root=str(root), **kw)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(f"data.root={root} has "), msg
  return msg


BAD_CONTENT = {
    "random.png": (b"\x13\x37 these are not the bytes of any image format" * 8,
                   "cannot identify image file"),
    "empty.png": (b"", "empty file"),
    "truncated.png": (_half("PNG"), "Truncated File Read"),
    "truncated.jpg": (_half("JPEG"), "truncated JPEG (no end-of-image marker)"),
    "tiff.jpeg": (_encoded("TIFF"), "a TIFF image, not JPEG or PNG"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONTENT))
def test_unreadable_image_is_reported(tmp_path, name):
  _clean(tmp_path)
  content, why = BAD_CONTENT[name]
  _write_bytes(tmp_path / "train" / "cat" / name, content)
  msg = _error(tmp_path)
  assert msg.startswith(f"data.root={tmp_path} has 1 problem: 1 unreadable or non-image file "
                        f"(train/cat/{name}: {why}")
  assert msg.endswith("Fix or remove them, or set data.skip_unreadable=true to skip unreadable "
                      "and non-image files.")


def test_non_image_files_in_a_class_folder_are_reported(tmp_path):
  _clean(tmp_path)
  (tmp_path / "train" / "dog" / "notes.txt").write_text("x")
  Image.new("RGB", (4, 4)).save(tmp_path / "train" / "dog" / "x.gif")
  (tmp_path / "test" / "cat" / "nested").mkdir()
  msg = _error(tmp_path)
  assert ("has 3 problems: 3 unreadable or non-image files (test/cat/nested: a folder, not an "
          "image; train/dog/notes.txt: not a .jpg/.jpeg/.png image; train/dog/x.gif: not a "
          ".jpg/.jpeg/.png image).") in msg
  assert "data.skip_unreadable=true" in msg


def test_empty_class_folder_is_reported(tmp_path):
  _clean(tmp_path, classes=("bird", "cat"))
  for f in (tmp_path / "train" / "bird").iterdir():
    f.unlink()
  msg = _error(tmp_path)
  assert "has 1 problem: 1 class folder with no images (train/bird/)." in msg
  assert "skip_unreadable" not in msg and "same class sub-folders" in msg


def test_class_missing_from_a_split_is_reported(tmp_path):
  _clean(tmp_path)
  _png(tmp_path / "test" / "bird" / "a.png")
  _png(tmp_path / "validation" / "cat" / "a.png")
  msg = _error(tmp_path)
  assert ("has 2 problems: 2 classes missing from a split ('bird' is in test/ but not in train/, "
          "validation/; 'dog' is in test/, train/ but not in validation/).") in msg
  assert "skip_unreadable" not in msg


def test_split_without_images_is_reported(tmp_path):
  _clean(tmp_path, splits=("train",))
  (tmp_path / "test").mkdir()
  msg = _error(tmp_path)
  assert "has 1 problem: 1 empty split (test/ has no images)." in msg


def test_all_faults_in_one_message(tmp_path):
  _clean(tmp_path)
  _write_bytes(tmp_path / "train" / "cat" / "a.png", b"garbage")
  (tmp_path / "train" / "dog" / "notes.txt").write_text("x")
  (tmp_path / "train" / "empty").mkdir()
  (tmp_path / "test" / "empty").mkdir()
  _png(tmp_path / "test" / "bird" / "b.png")
  (tmp_path / "validation" / "cat").mkdir(parents=True)
  assert _error(tmp_path) == (
      f"data.root={tmp_path} has 7 problems: 2 unreadable or non-image files (train/cat/a.png: "
      "cannot identify image file; train/dog/notes.txt: not a .jpg/.jpeg/.png image); 3 class "
      "folders with no images (test/empty/, train/empty/, validation/cat/); 1 class missing from "
      "a split ('bird' is in test/ but not in train/); 1 empty split (validation/ has no images). "
      "Fix or remove them, or set data.skip_unreadable=true to skip unreadable and non-image "
      "files. Every split needs the same class sub-folders, each holding at least one "
      ".jpg/.jpeg/.png image.")


def test_many_bad_files_exact_count_first_few_listed(tmp_path):
  _clean(tmp_path)
  for i in range(8):
    _write_bytes(tmp_path / "train" / "cat" / f"bad{i}.png", b"nope")
  msg = _error(tmp_path)
  assert "has 8 problems: 8 unreadable or non-image files (" in msg
  assert all(f"train/cat/bad{i}.png" in msg for i in range(5))
  assert not any(f"train/cat/bad{i}.png" in msg for i in range(5, 8))
  assert "; and 3 more)" in msg


def test_jpeg_end_marker(tmp_path):
  """A JPEG cut in half fails; a whole one with a few padding bytes after FF D9 is fine (and
  tf.io.decode_image reads it)."""
  _clean(tmp_path)
  jpeg = _encoded("JPEG")
  assert jpeg.endswith(b"\xff\xd9")
  _write_bytes(tmp_path / "train" / "cat" / "padded.jpg", jpeg + b"\0" * 8)
  _write_bytes(tmp_path / "train" / "cat" / "garbage.jpg", jpeg + b"\x01\x02\x03")
  _write_bytes(tmp_path / "train" / "dog" / "whole.JPEG", jpeg)
  source = data.open_source("image_folder", root=str(tmp_path))
  assert source.splits["train"] == 7
  batches = list(data.eval_batches(source, "train", SPEC, 7).as_numpy_iterator())
  assert batches[0]["_mask"].all()
  _write_bytes(tmp_path / "train" / "dog" / "half.jpg", jpeg[:len(jpeg) // 2])
  _write_bytes(tmp_path / "train" / "dog" / "half.png", _encoded("PNG")[:-100])
  msg = _error(tmp_path)
  assert ("2 unreadable or non-image files (train/dog/half.jpg: truncated JPEG (no end-of-image "
          "marker); train/dog/half.png: ") in msg


def test_hidden_files_and_loose_files_are_ignored(tmp_path):
  _clean(tmp_path)
  (tmp_path / "train" / "cat" / ".DS_Store").write_bytes(b"\0\1\2")
  (tmp_path / "train" / "cat" / "._ok0.png").write_bytes(b"AppleDouble")
  (tmp_path / "train" / ".ipynb_checkpoints").mkdir()
  (tmp_path / ".cache" / "x").mkdir(parents=True)
  (tmp_path / "test" / "README.txt").write_text("loose in a split")
  (tmp_path / "LICENSE").write_text("loose at the root")
  source = data.open_source("image_folder", root=str(tmp_path))
  assert source.splits == {"test": 4, "train": 4}
  assert source.builder.info.features["label"].names == ["cat", "dog"]


def test_skip_unreadable_warns_once_and_leaves_the_files_out(tmp_path, capsys):
  _clean(tmp_path, n=3)
  _write_bytes(tmp_path / "train" / "cat" / "a.png", b"garbage")
  _write_bytes(tmp_path / "train" / "dog" / "b.jpg", _encoded("JPEG")[:300])
  (tmp_path / "train" / "dog" / "notes.txt").write_text("x")
  source = data.open_source("image_folder", root=str(tmp_path), skip_unreadable=True)
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"warning: skipped 3 unreadable or non-image files (train/cat/a.png, "
                 f"train/dog/b.jpg, train/dog/notes.txt) in data.root={tmp_path}"]
  assert source.splits == {"test": 6, "train": 6}
  names = _filenames(source, "train")
  assert len(names) == 6 and all(os.path.basename(n).startswith("ok") for n in names)
  batches = list(data.eval_batches(source, "train", SPEC, 4).as_numpy_iterator())
  assert sum(int(b["_mask"].sum()) for b in batches) == 6
  batch = next(data.train_batches(source, "train", SPEC, 6, seed=0))
  assert batch["image"].shape == (6, 16, 16, 3)
  np.testing.assert_array_equal(batch["labels"].sum(0), [3, 3])


def test_open_data_passes_skip_unreadable_on(tmp_path, capsys):
  _clean(tmp_path)
  _write_bytes(tmp_path / "train" / "cat" / "a.png", b"garbage")
  with pytest.raises(DataError, match="data.skip_unreadable=true"):
    open_data(_config(tmp_path))
  _, source = open_data(_config(tmp_path, skip_unreadable=True))
  assert source.splits == {"test": 4, "train": 4}
  assert "warning: skipped 1 unreadable or non-image file (train/cat/a.png)" in (
      capsys.readouterr().err)


def test_skip_unreadable_still_fails_on_a_class_left_empty(tmp_path, capsys):
  _clean(tmp_path, classes=("bird", "cat"))
  for i in range(2):
    _write_bytes(tmp_path / "train" / "bird" / f"ok{i}.png", b"garbage")
  msg = _error(tmp_path, skip_unreadable=True)
  assert msg.endswith(" has 1 problem: 1 class folder with no images (train/bird/). Every split "
                      "needs the same class sub-folders, each holding at least one .jpg/.jpeg/.png "
                      "image.")
  assert capsys.readouterr().err.startswith("warning: skipped 2 unreadable or non-image files")
