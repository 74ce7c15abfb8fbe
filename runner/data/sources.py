"""Opening a dataset by name: embedded offline builders, any prepared TFDS dataset, an image folder,
or a file of image-caption pairs. Every failure here happens before any compute and says what is
valid instead."""
from __future__ import annotations

import dataclasses
import os
import re
import sys

import tensorflow_datasets as tfds

from runner.data import caption_file, image_folder
from runner.data import captions  # noqa: F401  (registers the captioned digit sets in EMBEDDED)
from runner.data.embedded import EMBEDDED
from runner.data.tensorflow_on_use import tensorflow, tf
from runner.errors import UserError

IMAGE_FOLDER = "image_folder"
CAPTIONS = "captions"
_SLICE = re.compile(r"^(?P<name>[\w-]+)(\[(?P<start>(-?\d+%?)?):(?P<stop>(-?\d+%?)?)\])?$")


class DataError(UserError, ValueError):
  """A dataset that cannot be opened: unknown, not prepared, missing split, wrong folder."""


@dataclasses.dataclass
class Source:
  """An opened dataset: its builder, label space and split sizes, and where its captions are.
  An image-text dataset without classes has num_classes 0 and no class_names."""
  name: str
  builder: tfds.core.DatasetBuilder
  num_classes: int
  multilabel: bool
  image_key: str = "image"
  label_key: str = "label"
  text_key: str | None = None  # a caption, or several ('captions/text' of coco_captions)
  class_names: list[str] | None = None

  @property
  def splits(self) -> dict[str, int]:
    return {name: info.num_examples for name, info in self.builder.info.splits.items()}

  def has_split(self, split: str) -> bool:
    try:
      self.num_examples(split)
      return True
    except DataError:
      return False

  def num_examples(self, split: str) -> int:
    name, start, stop = self._slice(split)
    return stop - start

  def head(self, split: str, count: int) -> str:
    """The first `count` examples of `split` as an absolute sub-split ('train[:98%]', 500 ->
    'train[0:500]'), so that a cap composes with a slice."""
    name, start, stop = self._slice(split)
    return f"{name}[{start}:{min(stop, start + max(0, count))}]"

  def _slice(self, split: str) -> tuple[str, int, int]:
    match = _SLICE.match(split.replace(" ", ""))
    if not match or match["name"] not in self.splits:
      raise DataError(f"dataset {self.name!r} has no split {split!r}; its splits are "
                      f"{', '.join(f'{k} ({v} examples)' for k, v in self.splits.items())}. "
                      "Sub-splits like 'train[:90%]' or 'train[100:]' are accepted.")
    total = self.splits[match["name"]]

    def bound(text, default):
      if not text:
        return default
      value = int(text.rstrip("%"))
      value = round(value * total / 100) if text.endswith("%") else value
      return max(0, min(total, value if value >= 0 else total + value))
    start, stop = bound(match["start"], 0), bound(match["stop"], total)
    if stop <= start:
      raise DataError(f"split {split!r} of dataset {self.name!r} is empty ({total} examples in "
                      f"{match['name']!r}, slice [{start}:{stop}]).")
    return match["name"], start, stop

  def read(self, split: str, process_index: int = 0, process_count: int = 1, *,
           drop_remainder: bool = True, with_index: bool = False) -> tf.data.Dataset:
    """Raw examples of `split` (encoded images), this process's contiguous share of them: with
    drop_remainder every process gets n // count (training: equal streams); without, the first
    n % count processes get one more, so every example is read once. `with_index` adds `_index`,
    each example's position in its named split (stable across processes, slices and epochs)."""
    name, first, last = self._slice(split)
    begin, end = process_share(last - first, process_index, process_count, drop_remainder)
    start, stop = first + begin, first + end
    decoders = {self.image_key: tfds.decode.SkipDecoding()}
    if isinstance(self.builder, tfds.folder_dataset.ImageFolder):
      # ImageFolder has no sub-split API; its record order is already a fixed shuffle.
      ds = self.builder.as_dataset(split=name, shuffle_files=False, decoders=decoders)
      ds = ds.skip(start).take(stop - start)
    else:
      read_config = tfds.ReadConfig(interleave_cycle_length=1, add_tfds_id=False)
      ds = self.builder.as_dataset(split=f"{name}[{start}:{stop}]", shuffle_files=False,
                                   decoders=decoders, read_config=read_config)
    if with_index:
      ds = tf.data.Dataset.zip(tf.data.Dataset.range(start, stop), ds).map(
          lambda index, example: {**example, "_index": index})
    return ds

  def captions(self, split: str) -> list[str]:
    """Every caption of `split` (all of an example's), in order: the text a tokenizer trains on."""
    if not self.text_key:
      raise DataError(f"dataset {self.name!r} has no captions: set data.text_key to its text "
                      f"feature (its features are {sorted(self.builder.info.features.keys())}).")
    key = self.text_key
    ds = self.read(split).map(lambda example: tf.reshape(text_of(example, key), [-1])).unbatch()
    return [text.decode("utf-8", "replace") for batch in ds.batch(4096).as_numpy_iterator()
            for text in batch.tolist()]


def text_of(example: dict, key: str) -> tf.Tensor:
  """The feature at a '/'-separated path of a (nested) example: 'caption', 'captions/text'."""
  for part in key.split("/"):
    example = example[part]
  return example


def process_share(n: int, index: int, count: int, drop_remainder: bool) -> tuple[int, int]:
  """[start, stop) of process `index` among `count` in n examples."""
  if drop_remainder:
    share = n // count
    return index * share, (index + 1) * share
  base, extra = divmod(n, count)
  start = index * base + min(index, extra)
  return start, start + base + (1 if index < extra else 0)


def known_names() -> list[str]:
  return sorted(EMBEDDED) + [IMAGE_FOLDER, CAPTIONS]


def open_source(name: str, data_dir: str | None = None, root: str | None = None,
                image_key: str = "image", label_key: str = "label",
                skip_unreadable: bool = False, text_key: str | None = None) -> Source:
  """Opens (and for embedded datasets, prepares) a dataset, or raises DataError explaining why not.
  skip_unreadable (image folders and caption files) leaves out unreadable and non-image files with
  a warning instead of failing. With `text_key` (the captions), a dataset needs no label."""
  data_dir = (data_dir or os.environ.get("TFDS_DATA_DIR")
              or os.path.expanduser("~/tensorflow_datasets"))
  if name == IMAGE_FOLDER:
    builder = _image_folder(root, skip_unreadable)
  elif name == CAPTIONS:
    builder = _caption_file(root, skip_unreadable)
    text_key = text_key or "caption"
  elif name in EMBEDDED:
    builder = EMBEDDED.get(name)(data_dir=_readable(data_dir))
    if not _is_prepared(builder):
      tensorflow()  # set up before TFDS prepares with it
      try:
        builder.download_and_prepare()
      except FileExistsError:  # another process (host, job) published it first: use theirs
        if not _is_prepared(builder):
          raise
        builder = EMBEDDED.get(name)(data_dir=data_dir)
      except OSError as e:  # a file, or a folder this user cannot create or write
        raise DataError(f"cannot prepare the embedded dataset {name!r} under data_dir "
                        f"{data_dir!r}: {e.strerror} ({e.filename}). Give a folder you can write "
                        "to: data.data_dir=<dir>, or TFDS_DATA_DIR.") from None
  else:
    builder = _prepared_tfds_builder(name, _readable(data_dir))
  tensorflow()  # set up before TFDS reads with it
  features = builder.info.features
  if text_key:
    _check_text_feature(name, features, text_key)
  if image_key not in features or (label_key not in features and not text_key):
    raise DataError(f"dataset {name!r} has features {sorted(features.keys())}; expected an image "
                    f"under {image_key!r} and a label under {label_key!r} "
                    "(set data.image_key / data.label_key).")
  if label_key not in features:  # image-text pairs without classes
    return Source(name=name, builder=builder, num_classes=0, multilabel=False,
                  image_key=image_key, label_key=label_key, text_key=text_key)
  label = features[label_key]
  multilabel = isinstance(label, tfds.features.Sequence)
  label = label.feature if multilabel else label
  if not isinstance(label, tfds.features.ClassLabel):
    raise DataError(f"feature {label_key!r} of dataset {name!r} is not a class label.")
  return Source(name=name, builder=builder, num_classes=label.num_classes, multilabel=multilabel,
                image_key=image_key, label_key=label_key, text_key=text_key,
                class_names=list(label.names))


def _check_text_feature(name: str, features, key: str) -> None:
  """`key` names a string feature: one caption, or a sequence of them ('captions/text')."""
  feature, rank = features, 0  # rank: of the example's tensor, one per sequence on the way
  try:
    for part in key.split("/"):
      feature = feature[part]
      while isinstance(feature, tfds.features.Sequence):
        feature, rank = feature.feature, rank + 1
    ok = feature.tf_dtype == tf.string and rank + len(feature.shape) <= 1
  except (KeyError, TypeError, AttributeError):
    ok = False
  if not ok:
    raise DataError(f"data.text_key={key!r} names no caption (text) feature of dataset {name!r}; "
                    f"its features are {_feature_paths(features)}. Nested features are named "
                    "with '/', e.g. captions/text.")


def _feature_paths(features, prefix: str = "") -> list[str]:
  """'image', 'captions/text', ...: every leaf feature of a (nested) FeaturesDict."""
  if isinstance(features, tfds.features.Sequence):
    features = features.feature
  if not isinstance(features, tfds.features.FeaturesDict):
    return [prefix.rstrip("/")]
  return [path for key in sorted(features.keys())
          for path in _feature_paths(features[key], f"{prefix}{key}/")]


def _readable(data_dir: str) -> str:
  """A data_dir URL that TFDS's paths (etils) or TensorFlow cannot read fails here, not in TFDS."""
  try:
    if "://" in data_dir:
      tensorflow()  # etils reads a URL through TensorFlow's file systems once it is loaded
      tfds.core.Path(data_dir).exists()
    return data_dir
  except KeyError:  # etils knows no such scheme
    why = f"TFDS reads no {data_dir.split('://')[0]}:// paths"
  except tf.errors.OpError as e:
    why = e.message.splitlines()[0]
  raise DataError(f"data_dir {data_dir!r} cannot be read: {why}. A data_dir (data.data_dir, or "
                  "TFDS_DATA_DIR) is a local folder, written without file://, or a URL that TFDS "
                  "and TensorFlow both read, such as gs://<bucket>/tensorflow_datasets.")


def _is_prepared(builder) -> bool:
  """A local folder is read with `os`: an unprepared dataset is refused without TensorFlow."""
  return tfds.core.Path(builder.data_dir, "dataset_info.json").exists()


def _image_folder(root: str | None, skip_unreadable: bool = False):
  """Scans the whole folder first, so that every fault is reported at once and before compute."""
  if not root:
    raise DataError("data=image_folder needs data.root=<dir>, a folder holding train/ and test/ "
                    "(optionally validation/) with one sub-folder of images per class.")
  root = os.path.expanduser(root)
  if not os.path.isdir(os.path.join(root, "train")):
    found = sorted(os.listdir(root)) if os.path.isdir(root) else None
    raise DataError(f"data.root={root!r} must contain a train/ folder of class sub-folders "
                    f"(and test/, optionally validation/); "
                    + (f"it contains {found}." if found is not None else "it does not exist."))
  return image_folder.ScannedImageFolder(root, _checked(image_folder.scan(root), skip_unreadable))


def _caption_file(root: str | None, skip_unreadable: bool = False) -> caption_file.CaptionFile:
  """Checks every row and image of the file first, so that all faults are reported at once."""
  files = " or ".join(caption_file.FILE_NAMES)
  if not root:
    raise DataError("data=captions needs data.root=<path>: a .jsonl or .csv file of rows (image, "
                    f"caption[, split]), or a folder holding {files}.")
  path = os.path.expanduser(root)
  if os.path.isdir(path):
    found = [f for f in caption_file.FILE_NAMES if os.path.isfile(os.path.join(path, f))]
    if len(found) != 1:
      raise DataError(f"data.root={root!r} is a folder, which must hold one of {files}; it holds "
                      + ("both." if found else f"{sorted(os.listdir(path))[:10]}."))
    path = os.path.join(path, found[0])
  elif not os.path.isfile(path):
    raise DataError(f"data.root={root!r} does not exist; it must be a .jsonl or .csv file of "
                    f"rows (image, caption[, split]), or a folder holding {files}.")
  elif not path.lower().endswith((".jsonl", ".csv")):
    raise DataError(f"data.root={root!r} is neither a .jsonl nor a .csv file of rows (image, "
                    f"caption[, split]), nor a folder holding {files}.")
  return caption_file.CaptionFile(path, _checked(caption_file.scan(path), skip_unreadable))


def _checked(scan, skip_unreadable: bool) -> dict:
  """A scan's usable examples; a warning names what skip_unreadable left out, DataError the rest."""
  if skip_unreadable and scan.warning():
    print(scan.warning(), file=sys.stderr)
  if error := scan.error(skip_unreadable):
    raise DataError(error)
  return scan.examples


def _prepared_tfds_builder(name: str, data_dir: str):
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    raise DataError(
        f"unknown dataset {name!r}: it is neither embedded ({', '.join(sorted(EMBEDDED))}), nor "
        f"'{IMAGE_FOLDER}' (with data.root=<dir>), nor '{CAPTIONS}' (with data.root=<file of "
        "image-caption pairs>), nor a TFDS dataset name (e.g. cifar10, cifar100, imagenet2012, "
        "oxford_iiit_pet).") from None
  except Exception as e:  # a TFDS builder whose module cannot import, a bad config name...
    raise DataError(f"TFDS cannot open dataset {name!r}: {e}") from None
  if not _is_prepared(builder):
    raise DataError(
        f"TFDS dataset {name!r} is not prepared under data_dir {data_dir!r} (looked for "
        f"{builder.data_dir}). Prepare it where the network is reachable, e.g. `tfds build {name} "
        f"--data_dir {data_dir}`, and copy the folder here; or pass data.data_dir=<dir> where it "
        f"is prepared. Offline alternatives: {', '.join(sorted(EMBEDDED))}, data=image_folder "
        "data.root=<dir>, or data=captions data.root=<file of image-caption pairs>.")
  return builder
