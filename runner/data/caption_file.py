"""A user's image-caption pairs: a JSONL or CSV file of rows (image, caption[, split]), image paths
relative to its folder, `split` one of SPLITS (train if none). Every row and image is checked before
any compute, so that a user fixes all faults at once; then `CaptionFile` reads the rows."""
from __future__ import annotations

import collections
import concurrent.futures
import csv
import dataclasses
import io
import json
import os
import random
import re

import tensorflow_datasets as tfds

from runner.data.image_folder import listed, unreadable
from runner.data.tensorflow_on_use import tf

FILE_NAMES = ("captions.jsonl", "captions.csv")  # what a data.root folder may hold
SPLITS = ("train", "validation", "test")
_SPLIT = re.compile(r"^(?P<name>\w+)(\[(?P<start>\d*):(?P<stop>\d*)\])?$")

Pair = collections.namedtuple("Pair", ["image_path", "caption"])  # absolute image path


KINDS = {  # kinds of fault in a row: (one, many)
    "json": ("line that is not a JSON object", "lines that are not JSON objects"),
    "image": ("row without an image", "rows without an image"),
    "caption": ("row with an empty or missing caption", "rows with an empty or missing caption"),
    "split": ("row with an unknown split", "rows with an unknown split"),
    "missing": ("missing image file", "missing image files"),
    "unreadable": ("unreadable or non-image file", "unreadable or non-image files"),
}
SKIPPABLE = ("missing", "unreadable")  # what skip_unreadable leaves out


@dataclasses.dataclass
class Scan:
  """What a scan of a caption file found: the usable pairs of each split and every fault."""
  path: str
  examples: dict[str, list[Pair]]  # split -> usable pairs, in file order
  faults: dict[str, list[str]]  # kind (KINDS) -> 'line 3: a.png', in file order
  file_faults: list[str]  # the file's own: 'no rows', a CSV header without the columns...

  def error(self, skip_unreadable: bool = False) -> str | None:
    """All faults that stop the run as one paragraph naming the file, or None if there are none."""
    faults = {kind: rows for kind, rows in self.faults.items()
              if rows and not (skip_unreadable and kind in SKIPPABLE)}
    parts = self.file_faults + [listed(rows, *KINDS[kind]) for kind, rows in faults.items()]
    if not parts and "train" not in self.examples:
      parts = ["no training rows left once those whose image is missing or unreadable are skipped"]
    if not parts:
      return None
    count = max(1, len(self.file_faults) + sum(len(rows) for rows in faults.values()))
    hints = ["Each row needs `image`, the path of a JPEG, PNG, GIF or BMP image relative to the "
             "file's folder, and a non-empty `caption`; optionally `split` (train, validation or "
             "test; train if empty)."]
    if any(kind in SKIPPABLE for kind in faults):
      hints.append("Fix or remove these rows, or set data.skip_unreadable=true to leave out the "
                   "rows whose image is missing or unreadable.")
    problems = f"{count} problem" if count == 1 else f"{count} problems"
    return f"data.root={self.path} has {problems}: {'; '.join(parts)}. {' '.join(hints)}"

  def warning(self) -> str | None:
    """The line saying which rows skip_unreadable left out, or None if it left out none."""
    skipped = [row for kind in SKIPPABLE for row in self.faults[kind]]
    if not skipped:
      return None
    rows = listed(skipped, "row whose image is missing or unreadable",
                 "rows whose image is missing or unreadable")
    return f"warning: skipped {rows} in data.root={self.path}"


def scan(path: str, workers: int = 8) -> Scan:
  """Reads every row of the file and checks every image; threads hide file-system latency."""
  faults = {kind: [] for kind in KINDS}
  file_faults = []
  folder = os.path.dirname(os.path.abspath(path))
  rows = []  # (line, image as written, its absolute path, caption, split) of well-formed rows
  splits = collections.Counter()
  for line, row in _rows(path, faults, file_faults):
    image = str(row.get("image") or "").strip()
    text = row.get("caption")
    text = text.strip() if isinstance(text, str) else ""
    split = str(row.get("split") or "").strip() or "train"
    splits[split] += 1
    if not image:
      faults["image"].append(f"line {line}")
    if not text:
      faults["caption"].append(f"line {line}")
    if split not in SPLITS:
      faults["split"].append(f"line {line}: {split!r}")
    if image and text and split in SPLITS:
      rows.append((line, image, os.path.join(folder, os.path.expanduser(image)), text, split))
  if not splits and not file_faults and not faults["json"]:
    file_faults.append("no rows")
  elif splits and not splits["train"]:
    file_faults.append("no training rows (rows without a split, or with split train)")

  paths = sorted({full for _, _, full, _, _ in rows})
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    why = dict(zip(paths, pool.map(
        lambda path: "missing" if not os.path.isfile(path) else unreadable(path), paths)))
  examples = {}
  for line, image, full, text, split in rows:
    if why[full] == "missing":
      faults["missing"].append(f"line {line}: {image}")
    elif why[full]:
      faults["unreadable"].append(f"line {line}: {image}: {why[full]}")
    else:
      examples.setdefault(split, []).append(Pair(full, text))
  return Scan(path=path, examples=examples, faults=faults, file_faults=file_faults)


def _rows(path: str, faults: dict[str, list[str]], file_faults: list[str]):
  """(line number, row dict) of a .jsonl or .csv file; what is no row goes to the faults."""
  try:
    with open(path, newline="", encoding="utf-8-sig") as f:
      content = f.read()
  except UnicodeDecodeError as e:
    file_faults.append(f"bytes that are not UTF-8 text (at byte {e.start})")
    return
  if path.lower().endswith(".csv"):
    reader = csv.DictReader(io.StringIO(content, newline=""))
    if missing := [c for c in ("image", "caption") if c not in (reader.fieldnames or [])]:
      file_faults.append(f"a header with columns {reader.fieldnames or []}, without "
                         f"{' and '.join(missing)} (the first line names the columns)")
      return
    for row in reader:
      yield reader.line_num, row
    return
  for line, text in enumerate(content.split("\n"), start=1):
    if not text.strip():
      continue
    try:
      row = json.loads(text)
    except json.JSONDecodeError:
      row = None
    if isinstance(row, dict):
      yield line, row
    else:
      faults["json"].append(f"line {line}")


@dataclasses.dataclass
class _Info:
  features: tfds.features.FeaturesDict
  splits: tfds.core.SplitDict


class CaptionFile:
  """The checked pairs, read as Source reads a TFDS builder; each split in a fixed shuffled order
  (random.Random(split name), as tfds' ImageFolder), so a held-out slice of train samples it."""
  name = "captions"

  def __init__(self, path: str, examples: dict[str, list[Pair]]):
    self.data_dir = os.path.dirname(os.path.abspath(path))
    self._pairs = {}
    for split in sorted(examples):
      pairs = list(examples[split])
      random.Random(split).shuffle(pairs)
      self._pairs[split] = pairs
    self.info = _Info(
        features=tfds.features.FeaturesDict({"image": tfds.features.Image(),
                                             "caption": tfds.features.Text()}),
        splits=tfds.core.SplitDict([
            tfds.core.SplitInfo(name=split, shard_lengths=[len(pairs)], num_bytes=0)
            for split, pairs in self._pairs.items()]))

  def as_dataset(self, split: str, shuffle_files: bool = False, decoders=None,
                 read_config=None) -> tf.data.Dataset:
    """Examples {'image', 'caption'} of a split or slice 'train[10:20]', in the split's order;
    images stay encoded when decoders skip decoding them (as Source.read asks)."""
    del shuffle_files, read_config  # one fixed order; nothing to interleave
    match = _SPLIT.match(str(split).replace(" ", ""))
    if not match or match["name"] not in self._pairs:
      raise ValueError(f"no split {split!r} in {sorted(self._pairs)}")
    pairs = self._pairs[match["name"]]
    pairs = pairs[int(match["start"] or 0):int(match["stop"] or len(pairs))]
    skip = isinstance((decoders or {}).get("image"), tfds.decode.SkipDecoding)

    def read(path, text):
      image = tf.io.read_file(path)
      if not skip:
        image = tf.io.decode_image(image, expand_animations=False)
      return {"image": image, "caption": text}
    ds = tf.data.Dataset.from_tensor_slices((tf.constant([p.image_path for p in pairs], tf.string),
                                             tf.constant([p.caption for p in pairs], tf.string)))
    return ds.map(read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
