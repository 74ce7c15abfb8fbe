"""Opening datasets by name (runner/data/sources.py): errors, sub-splits, the real named-TFDS path.

`VmoeTestShapes` / `VmoeTestMultilabel` are ordinary TFDS GeneratorBasedBuilders defined here and
registered with TFDS under their snake_case names; they are prepared into a temporary data_dir
and then opened by name through `open_source`, i.e. through `tfds.builder(name, data_dir=...)`,
the same code path that opens a prepared cifar10 or imagenet2012.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from runner import data
from runner.data import DataError, tensorflow_on_use
from runner.models import inputs
from runner.errors import UserError

TRAIN, TEST = 30, 12


def _shape_images(seed: int, n: int):
  rng = np.random.default_rng(seed)
  for i in range(n):
    yield i, rng.integers(0, 256, (6, 6, 3), dtype=np.uint8), i % 3


class VmoeTestShapes(tfds.core.GeneratorBasedBuilder):
  """Tiny random 6x6 RGB images, 3 classes, train (30) / test (12), plus a non-label feature."""
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Test data."}

  # DatasetInfo directly (not dataset_info_from_configs): that one reads README/CITATIONS
  # metadata from the package folder of the defining module (`pkg_dir_path`).
  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(6, 6, 3)),
            "label": tfds.features.ClassLabel(names=["circle", "square", "triangle"]),
            "index": tfds.features.Scalar(dtype=np.int64),
        }),
        supervised_keys=("image", "label"))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples(0, TRAIN), "test": self._generate_examples(1, TEST)}

  def _generate_examples(self, seed, n):
    for i, image, label in _shape_images(seed, n):
      yield i, {"image": image, "label": label, "index": i}


MULTI_LABELS = [[0], [1, 3], [2], [0, 1, 2, 3], [3, 3], [1]]


class VmoeTestMultilabel(tfds.core.GeneratorBasedBuilder):
  """Six 4x4 grey images, each with a list of labels out of 4."""
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Test data."}

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(4, 4, 1)),
            "label": tfds.features.Sequence(tfds.features.ClassLabel(num_classes=4)),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"test": self._generate_examples()}

  def _generate_examples(self):
    for i, labels in enumerate(MULTI_LABELS):
      yield i, {"image": np.full((4, 4, 1), 40 * i, np.uint8), "label": labels}


@pytest.fixture(scope="module")
def test_data_dir(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds_named"))
  VmoeTestShapes(data_dir=data_dir).download_and_prepare()
  VmoeTestMultilabel(data_dir=data_dir).download_and_prepare()
  return data_dir


@pytest.fixture(scope="module")
def shapes(test_data_dir):
  return data.open_source("vmoe_test_shapes", data_dir=test_data_dir)


@pytest.fixture(scope="module")
def uci(tfds_dir):
  return data.open_source("uci_digits", data_dir=str(tfds_dir))


def expected_shapes(split: str) -> dict[int, tuple[np.ndarray, int]]:
  seed, n = {"train": (0, TRAIN), "test": (1, TEST)}[split]
  return {i: (image, label) for i, image, label in _shape_images(seed, n)}


def batches(ds) -> list[dict[str, np.ndarray]]:
  return list(ds.as_numpy_iterator())


# --- TensorFlow, set up on the first read --------------------------------------------------------

def test_opening_a_dataset_hides_the_accelerators_from_tensorflow(tfds_dir, monkeypatch):
  """The first dataset opened sets TensorFlow up (runner/data/tensorflow_on_use.py), before TFDS
  reads with it: no GPU for tf.data, whose memory JAX needs."""
  calls = []
  monkeypatch.setattr(tf.config, "set_visible_devices", lambda *args: calls.append(args))
  tensorflow_on_use.tensorflow.cache_clear()
  try:
    data.open_source("uci_digits", data_dir=str(tfds_dir))
    data.open_source("uci_digits", data_dir=str(tfds_dir))
  finally:
    tensorflow_on_use.tensorflow.cache_clear()
  assert calls == [([], "GPU")]  # once per process
  assert tensorflow_on_use.tf.data.Dataset is tf.data.Dataset  # and then it is TensorFlow


# --- errors -------------------------------------------------------------------------------------

def test_data_error_is_a_user_error():
  assert issubclass(DataError, UserError) and issubclass(DataError, ValueError)


def test_unknown_name_lists_the_alternatives(tmp_path):
  with pytest.raises(DataError) as e:
    data.open_source("no_such_dataset_xyz", data_dir=str(tmp_path))
  msg = str(e.value)
  for name in ("'no_such_dataset_xyz'", "mnist5k", "uci_digits", "image_folder", "cifar10"):
    assert name in msg


def test_registered_but_unprepared_tfds_dataset(tmp_path):
  with pytest.raises(DataError) as e:
    data.open_source("cifar10", data_dir=str(tmp_path))
  msg = str(e.value)
  assert f"tfds build cifar10 --data_dir {tmp_path}" in msg
  assert "not prepared" in msg and str(tmp_path / "cifar10") in msg
  assert "mnist5k" in msg and "image_folder" in msg  # offline alternatives


def test_own_builder_unprepared_in_another_dir(test_data_dir, tmp_path):
  with pytest.raises(DataError, match="tfds build vmoe_test_shapes"):
    data.open_source("vmoe_test_shapes", data_dir=str(tmp_path))


def test_bad_tfds_config_name_is_a_data_error(tmp_path):
  with pytest.raises(DataError, match="cannot open dataset"):
    data.open_source("vmoe_test_shapes/no_such_config", data_dir=str(tmp_path))


def test_missing_split_lists_the_splits(uci):
  with pytest.raises(DataError) as e:
    uci.num_examples("valid")
  msg = str(e.value)
  for part in ("'valid'", "train (1258 examples)", "validation (179 examples)",
               "test (360 examples)", "train[:90%]"):
    assert part in msg
  assert not uci.has_split("valid") and uci.has_split("validation")
  with pytest.raises(DataError):
    uci.read("valid")


@pytest.mark.parametrize("split", ["train[:10", "train[1:2:3]", "train[a:b]", "train[]",
                                   "train[1.5:]", "trai[:10]"])
def test_malformed_split_is_a_data_error(uci, split):
  with pytest.raises(DataError):
    uci.num_examples(split)
  assert not uci.has_split(split)


@pytest.mark.parametrize("split", ["train[-:]", "train[%:]", "train[:-%]"])
def test_bare_sign_or_percent_bound_is_a_data_error(uci, split):
  with pytest.raises(DataError, match="no split"):
    uci.num_examples(split)
  assert not uci.has_split(split)


@pytest.mark.parametrize("split,bounds", [("train[100:50]", "[100:50]"),
                                          ("train[50:50]", "[50:50]"),
                                          ("train[90%:10%]", "[1132:126]")])
def test_a_reversed_or_empty_slice_is_a_data_error(uci, split, bounds):
  """A slice with no example is refused, naming the split's size and the resolved bounds, rather
  than read as an empty split (a run over it would do nothing)."""
  with pytest.raises(DataError) as e:
    uci.num_examples(split)
  assert str(e.value) == (f"split {split!r} of dataset {uci.name!r} is empty (1258 examples in "
                          f"'train', slice {bounds}).")
  assert not uci.has_split(split)
  with pytest.raises(DataError):
    uci.read(split)


# --- sub-splits ---------------------------------------------------------------------------------

@pytest.mark.parametrize("split,n", [
    ("train", 1258), ("train[:]", 1258), ("train[:90%]", 1132), ("train[90%:]", 126),
    ("train[100:]", 1158), ("train[:100]", 100), ("train[-100:]", 100), ("train[:-100]", 1158),
    ("train[-10%:]", 126), ("train[10%:20%]", 126), ("validation[10:20]", 10),
    ("validation[:50%]", 90), ("validation[50%:]", 89), ("train[ : 50 ]", 50),
    ("train[:5000]", 1258), ("train[-5000:]", 1258), ("test[0%:100%]", 360),
])
def test_sub_split_sizes(uci, split, n):
  assert uci.num_examples(split) == n
  assert uci.has_split(split)


@pytest.mark.parametrize("pct", [1, 2, 33, 50, 67, 90, 98, 99])
def test_percent_slices_partition_the_split(uci, pct):
  for split in ("train", "validation", "test"):
    assert (uci.num_examples(f"{split}[:{pct}%]") + uci.num_examples(f"{split}[{pct}%:]")
            == uci.splits[split])


def _records(ds) -> list[tuple[bytes, int]]:
  return [(ex["image"], int(ex["label"])) for ex in tfds.as_numpy(ds)]


def test_read_gives_the_slice_of_the_full_split(uci):
  full = _records(uci.read("validation"))
  assert len(full) == 179
  assert isinstance(full[0][0], bytes)  # images are still encoded
  assert _records(uci.read("validation[10:20]")) == full[10:20]
  assert _records(uci.read("validation[-5:]")) == full[-5:]
  assert _records(uci.read("validation[:50%]")) == full[:90]
  assert _records(uci.read("validation")) == full  # a fixed order


def test_read_shares_are_contiguous_and_disjoint(uci):
  full = _records(uci.read("validation"))
  shares = [_records(uci.read("validation", i, 3)) for i in range(3)]
  assert [len(s) for s in shares] == [59, 59, 59]
  assert shares[0] + shares[1] + shares[2] == full[:177]
  sliced = [_records(uci.read("validation[20:40]", i, 2)) for i in range(2)]
  assert sliced[0] == full[20:30] and sliced[1] == full[30:40]


# --- a TFDS dataset opened by name -----------------------------------------------------------

def test_named_builder_opens_through_tfds(shapes, test_data_dir):
  assert shapes.name == "vmoe_test_shapes"
  assert shapes.num_classes == 3 and not shapes.multilabel
  assert shapes.splits == {"train": TRAIN, "test": TEST}
  assert shapes.builder.data_dir.startswith(test_data_dir)
  assert type(shapes.builder).__name__ == "VmoeTestShapes"


def test_named_builder_eval_batches(shapes):
  got = batches(data.eval_batches(shapes, "test", "decode(3)", 5))
  assert len(got) == 3
  want = expected_shapes("test")
  images = np.concatenate([b["image"] for b in got])
  labels = np.concatenate([b["labels"] for b in got])
  mask = np.concatenate([b["_mask"] for b in got])
  assert mask.tolist() == [True] * TEST + [False] * 3
  assert images.shape == (15, 6, 6, 3) and images.dtype == np.float32
  assert labels.shape == (15, 3) and labels.dtype == np.float32
  # every real row is one of the generated images with its own one-hot label, each once
  by_bytes = {img.astype(np.float32).tobytes(): y for img, y in want.values()}
  found = collections.Counter()
  for image, label in zip(images[:TEST], labels[:TEST]):
    key = image.tobytes()
    assert key in by_bytes
    np.testing.assert_array_equal(label, np.eye(3)[by_bytes[key]])
    found[key] += 1
  assert set(found.values()) == {1} and len(found) == TEST
  assert not images[TEST:].any() and not labels[TEST:].any()


def test_named_builder_train_batches_cover_each_epoch(shapes):
  stream = data.train_batches(shapes, "train", "decode(3)|value_range(0, 1)", 10, seed=5)
  want = {(img.astype(np.float32) / 255).round(4).tobytes(): y
          for img, y in expected_shapes("train").values()}
  for _ in range(2):  # two epochs of three batches each
    epoch = [next(stream) for _ in range(3)]
    images = np.concatenate([np.asarray(inputs.images(b)) for b in epoch]).round(4)
    labels = np.concatenate([b["labels"] for b in epoch])
    keys = [im.tobytes() for im in images]
    assert sorted(keys) == sorted(want)
    for key, label in zip(keys, labels):
      np.testing.assert_array_equal(label, np.eye(3)[want[key]])
    assert images.min() >= 0 and images.max() <= 1


def test_named_builder_with_augmentation_and_image_shape(shapes):
  spec = "decode(3)|resize(8)|random_crop(5)|flip_lr|value_range(-1, 1)"
  batch = next(data.train_batches(shapes, "train[:20]", spec, 4, seed=0))
  assert batch["image"].shape == (4, 5, 5, 3)
  images = np.asarray(inputs.images(batch))
  assert images.min() >= -1 and images.max() <= 1
  assert data.image_shape(shapes, "train", spec) == (5, 5, 3)
  assert data.image_shape(shapes, "test", "decode(3)") == (6, 6, 3)


def test_other_image_and_label_keys(test_data_dir):
  with pytest.raises(DataError, match="not a class label"):
    data.open_source("vmoe_test_shapes", data_dir=test_data_dir, label_key="index")
  with pytest.raises(DataError) as e:
    data.open_source("vmoe_test_shapes", data_dir=test_data_dir, image_key="img")
  assert "['image', 'index', 'label']" in str(e.value) and "data.image_key" in str(e.value)
  with pytest.raises(DataError, match="data.label_key"):
    data.open_source("vmoe_test_shapes", data_dir=test_data_dir, label_key="class")


def test_multilabel_builder_gives_multi_hot_labels(test_data_dir):
  source = data.open_source("vmoe_test_multilabel", data_dir=test_data_dir)
  assert source.multilabel and source.num_classes == 4
  got = batches(data.eval_batches(source, "test", "decode(1)", 4))
  labels = np.concatenate([b["labels"] for b in got])
  images = np.concatenate([b["image"] for b in got])
  assert labels.shape == (8, 4)
  # TFDS stores examples in key-hash order; the image's grey level names the example
  order = [int(v) // 40 for v in images[:6, 0, 0, 0]]
  assert sorted(order) == list(range(6))
  for row, i in enumerate(order):
    np.testing.assert_array_equal(labels[row], [float(c in MULTI_LABELS[i]) for c in range(4)])
  assert not labels[6:].any()


def test_spec_with_its_own_labels_is_kept(shapes):
  spec = "decode(3)|onehot(3, on=0.9, off=0.05)"
  batch = next(iter(data.eval_batches(shapes, "test", spec, 4).as_numpy_iterator()))
  assert np.isclose(batch["labels"].max(), 0.9) and np.isclose(batch["labels"].min(), 0.05)
  np.testing.assert_allclose(batch["labels"].sum(axis=1), 1.0, rtol=1e-6)
  assert set(batch) == {"image", "labels", "_mask"}


def test_eval_dataset_types(shapes):
  ds = data.eval_batches(shapes, "test", "decode(3)", 4)
  assert isinstance(ds, tf.data.Dataset)
  spec = ds.element_spec
  assert spec["_mask"].dtype == tf.bool and spec["image"].dtype == tf.float32
