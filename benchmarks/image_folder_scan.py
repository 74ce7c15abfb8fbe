"""How long data=image_folder's up-front scan takes: 20,000 small PNGs (32x32 noise), checked
with runner.data.image_folder.scan before any compute. A measurement run by hand, not a test, and
not in `make bench` (it writes 20,000 files to a temporary folder).

    .venv/bin/python -m benchmarks.image_folder_scan [--images 20000] [--workers 8]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

import numpy as np
from PIL import Image

from benchmarks import arguments


def _write_folder(root: pathlib.Path, count: int) -> None:
  """train/ gets 90% of the images, test/ 10%, over 7 classes."""
  rng = np.random.default_rng(0)
  for i in range(count):
    split = "test" if i % 10 == 0 else "train"
    folder = root / split / f"c{i % 7}"
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything is written."""
  parser = arguments.Parser(prog="benchmarks.image_folder_scan",
                            description=__doc__.splitlines()[0])
  parser.add_argument("--images", default="20000", help="PNGs written (>= 1)")
  parser.add_argument("--workers", default="8", help="the scan's threads (>= 1)")
  args = parser.parse_args(argv)
  args.images = parser.number("--images", args.images, int, 1)
  args.workers = parser.number("--workers", args.workers, int, 1)
  return args


def main(argv=None) -> None:
  args = parse(argv)
  from runner.data import image_folder  # imports TensorFlow: only once the arguments are good
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    _write_folder(root, args.images)
    for _ in range(3):  # the files are in the page cache: this times the checks, not the disk
      start = time.perf_counter()
      scan = image_folder.scan(str(root), workers=args.workers)
      seconds = time.perf_counter() - start
      found = sum(map(len, scan.examples.values()))
      print(f"{found} images, {len(scan.bad_files)} bad, {args.workers} workers, "
            f"{os.cpu_count()} cores: {seconds:.2f} s ({1e6 * seconds / found:.0f} us per image)")


if __name__ == "__main__":
  main()
