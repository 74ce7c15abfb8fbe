"""A user's image folder, <root>/<split>/<class>/<image>: scanned once, then read by a TFDS builder.
The scan runs before any compute and finds every fault at once (unreadable images, stray files,
empty classes, classes missing from a split, empty splits), so a user fixes them all in one go."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import random

import tensorflow_datasets as tfds
from PIL import Image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")  # what tfds' ImageFolder reads, in any case
SHOWN = 5  # paths (or caption rows) listed per kind of fault; the counts are always exact
_DECODABLE = {"JPEG", "MPO", "PNG", "GIF", "BMP"}  # tf.io.decode_image's formats, whatever suffix

Example = collections.namedtuple("Example", ["image_path", "label"])  # the fields tfds reads


@dataclasses.dataclass
class Scan:
  """What a scan found: the usable images of each split and every fault, paths relative to root."""
  root: str
  examples: dict[str, list[Example]]  # split -> usable images, (absolute path, class name)
  bad_files: list[tuple[str, str]]  # (path, why it is not a usable image)
  empty_classes: list[str]  # 'train/cat/': a class folder with no usable image
  missing_classes: list[str]  # "'bird' is in test/ but not in train/"
  empty_splits: list[str]  # 'train/'

  def error(self, skip_unreadable: bool = False) -> str | None:
    """The faults that stop the run as one line naming data.root, or None if there are none."""
    files = [] if skip_unreadable else [f"{path}: {why}" for path, why in self.bad_files]
    splits = [f"{split} has no images" for split in self.empty_splits]
    kinds = [(files, "unreadable or non-image file", "unreadable or non-image files", "; "),
             (self.empty_classes, "class folder with no images", "class folders with no images",
              ", "),
             (self.missing_classes, "class missing from a split", "classes missing from a split",
              "; "),
             (splits, "empty split", "empty splits", "; ")]
    parts = [listed(items, one, many, sep) for items, one, many, sep in kinds if items]
    if not parts:
      return None
    count = sum(len(items) for items, *_ in kinds)
    hints = []
    if files:
      hints.append("Fix or remove them, or set data.skip_unreadable=true to skip unreadable and "
                   "non-image files.")
    if self.empty_classes or self.missing_classes or self.empty_splits:
      hints.append("Every split needs the same class sub-folders, each holding at least one "
                   ".jpg/.jpeg/.png image.")
    problems = _count(count, "problem", "problems")
    return f"data.root={self.root} has {problems}: {'; '.join(parts)}. {' '.join(hints)}"

  def warning(self) -> str | None:
    """The one line saying which files skip_unreadable left out, or None if it left out none."""
    if not self.bad_files:
      return None
    files = listed([path for path, _ in self.bad_files], "unreadable or non-image file",
                  "unreadable or non-image files")
    return f"warning: skipped {files} in data.root={self.root}"


def scan(root: str, workers: int = 8) -> Scan:
  """Lists <root>/<split>/<class>/<image> and checks every image (threads hide file-system latency);
  hidden entries and files directly in root or in a split folder are not examples, so ignored."""
  candidates = {}  # split -> class -> [image path]
  stray = []  # (path, why): not an image, but inside a class folder
  for split in _folders(root):
    candidates[split] = {}
    for label in _folders(os.path.join(root, split)):
      images = candidates[split][label] = []
      for entry in sorted(os.scandir(os.path.join(root, split, label)), key=lambda e: e.name):
        if entry.name.startswith("."):
          continue
        if entry.is_dir():
          stray.append((entry.path, "a folder, not an image"))
        elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
          images.append(entry.path)
        else:
          stray.append((entry.path, "not a .jpg/.jpeg/.png image"))

  paths = [path for classes in candidates.values() for images in classes.values()
           for path in images]
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    why = dict(zip(paths, pool.map(unreadable, paths)))
  bad_files = sorted((os.path.relpath(path, root), reason)
                     for path, reason in stray + [(p, r) for p, r in why.items() if r])

  examples, empty_classes, empty_splits = {}, [], []
  for split, classes in candidates.items():
    examples[split] = [Example(path, label) for label, images in classes.items()
                       for path in images if not why[path]]
    empty_classes += [f"{split}/{label}/" for label, images in classes.items()
                      if all(why[path] for path in images)]
    if not examples[split]:
      empty_splits.append(f"{split}/")

  missing_classes = []
  compared = [s for s in candidates if examples[s]]  # an empty split is reported once, above
  for label in sorted({label for s in compared for label in candidates[s]}):
    have = [f"{s}/" for s in compared if label in candidates[s]]
    if lack := [f"{s}/" for s in compared if label not in candidates[s]]:
      missing_classes.append(f"'{label}' is in {', '.join(have)} but not in {', '.join(lack)}")
  return Scan(root=root, examples=examples, bad_files=bad_files, empty_classes=empty_classes,
              missing_classes=missing_classes, empty_splits=empty_splits)


def unreadable(path: str) -> str | None:
  """Why tf.io.decode_image would fail on the file, or None, by cheap checks. PIL's verify() checks
  a PNG's chunk CRCs (truncation) but next to nothing of a JPEG, which must end with its
  end-of-image marker FF D9 (bar a few bytes of padding, as some cameras write)."""
  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if not size:
        return "empty file"
      with Image.open(f) as image:
        kind = image.format
        image.verify()
      if kind not in _DECODABLE:
        return f"a {kind} image, not JPEG or PNG"
      if kind in ("JPEG", "MPO"):
        f.seek(max(0, size - 4096))
        if b"\xff\xd9" not in f.read().rstrip(b"\0")[-16:]:
          return "truncated JPEG (no end-of-image marker)"
  except Image.UnidentifiedImageError:
    return "cannot identify image file"
  except Exception as e:  # PIL raises many kinds on bad data: OSError, SyntaxError, struct.error...
    if isinstance(e, OSError) and e.strerror:
      return e.strerror  # permission denied...: without the absolute path str(e) carries
    return " ".join(str(e).split()) or type(e).__name__
  return None


class ScannedImageFolder(tfds.folder_dataset.ImageFolder, skip_registration=True):
  """tfds' ImageFolder over scanned, checked examples, so that skipped files stay out. Same label
  space and record order as tfds' own: labels are the sorted class names of all splits; each
  split is sorted by (class, path) and then shuffled with random.Random(split name)."""
  name = "image_folder"

  def __init__(self, root: str, examples: dict[str, list[tuple[str, str]]]):
    self._image_shape = self._image_dtype = None
    tfds.core.DatasetBuilder.__init__(self, data_dir=root)  # not ImageFolder's: it lists the folder
    self._data_dir = root  # the folder itself, not <root>/<name>/<version>
    self._split_examples = {}
    for split in sorted(examples):
      ordered = sorted((Example(*e) for e in examples[split]),
                       key=lambda e: (e.label, e.image_path))
      random.Random(split).shuffle(ordered)
      self._split_examples[split] = ordered
    self.info.features["label"].names = sorted(
        {e.label for split in self._split_examples.values() for e in split})
    self.info.set_splits(tfds.core.SplitDict([
        tfds.core.SplitInfo(name=split, shard_lengths=[len(ordered)], num_bytes=0)
        for split, ordered in self._split_examples.items()]))


def _folders(path: str) -> list[str]:
  return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def _count(n: int, one: str, many: str) -> str:
  return f"{n} {one if n == 1 else many}"


def listed(items: list[str], one: str, many: str, sep: str = ", ") -> str:
  """'3 things (a, b, c)', listing only the first SHOWN items."""
  more = f"{sep}and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
  return f"{_count(len(items), one, many)} ({sep.join(items[:SHOWN])}{more})"
