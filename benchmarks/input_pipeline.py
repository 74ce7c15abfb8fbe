"""Whether the input pipeline can feed an accelerator: training images per second at 224 px, per
CPU core, and what the training loop adds to the bare train step. A measurement run by hand, not
a test, and not in `make bench` (it writes a folder of JPEGs).

    .venv/bin/python -m benchmarks.input_pipeline [--images 2000] [--cores 1,2] [--loop-rounds 3]

1. The training stream (runner.data.train_batches, as `vmoe pretrain` reads it: shuffled,
   decoded, augmented, batched, the images left as uint8 pixels for the step to normalize) of an
   image folder of 320x256 JPEGs, of the same images as a prepared TFDS dataset, and of the same
   images decoded once into TFDS records of raw uint8 pixels (no JPEG decoding in the stream),
   with image_folder's default training preprocessing and with the papers' inception crop, at
   224 px; each in a process pinned to 1, 2, ... cores (sched_setaffinity before TensorFlow
   starts its thread pools).
2. The train step on uint8 pixels normalized inside it (what crosses to the device when the spec
   ends in value_range: runner/models/inputs.py) against the same step on float32 images, on
   this CPU: benchmarks/train_step.py's `tiny` preset (vmoe_tiny), alternating rounds.
3. The loop against the bare step, on this CPU: `vmoe pretrain` of vmoe_tiny (32 px, batch 128,
   the embedded MNIST) after warm-up, the images/s the run logs from the end of its first step
   to its last, against the same model's bare train step (benchmarks/train_step.py's `tiny`
   preset, which is vmoe_tiny), timed in the same process, the two alternating round by round.

Writes runs/benchmarks/input_pipeline.json (benchmarks/results/ with --record).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import arguments, harness
from runner import builtins

SIZE = 224
BATCH = 128
MIN_IMAGES = 20  # write_jpegs puts each of the 10 classes in test/ first, then in train/
PIPELINES = {  # what each measures: image_folder's default, and the V-MoE paper's upstream crop
    "resize_flip": f"decode(3)|resize({SIZE})|flip_lr|value_range(-1,1)",
    "inception_crop_flip": f"decode(3)|inception_crop({SIZE})|flip_lr|value_range(-1,1)",
}


def write_jpegs(root: pathlib.Path, count: int) -> None:
  """train/ of 10 classes of smooth 320x256 images (gradients and noise: JPEG-sized like photos,
  about 27-31 KB each), and a small test/."""
  from PIL import Image
  rng = np.random.default_rng(0)
  y, x = np.mgrid[0:256, 0:320]
  for i in range(count):
    split = "test" if (i // 10) % 20 == 0 else "train"  # every class in both
    folder = root / split / f"c{i % 10}"
    folder.mkdir(parents=True, exist_ok=True)
    base = (np.sin(x / rng.uniform(8, 40)) + np.cos(y / rng.uniform(8, 40)))[..., None]
    colour = rng.uniform(40, 200, 3) + 50 * base + rng.normal(0, 12, (256, 320, 3))
    Image.fromarray(np.clip(colour, 0, 255).astype(np.uint8)).save(folder / f"{i}.jpg",
                                                                    quality=90)


# The TFDS datasets made of the folder: its JPEGs as records (what `tfds build` writes of a
# downloaded dataset), and its images decoded once, as records of raw pixels.
RECORDS = {"tfds": "jpeg_records", "raw_tfds": "pixel_records"}


def prepared_tfds(root: pathlib.Path, data_dir: pathlib.Path) -> None:
  """The folder's images as the two prepared TFDS datasets of RECORDS."""
  import tensorflow_datasets as tfds
  tfds.disable_progress_bar()
  for kind in RECORDS:
    _records_builder(kind)(data_dir=str(data_dir), root=str(root)).download_and_prepare()


def _records_builder(kind: str):
  """The TFDS builder of RECORDS[kind] over the folder (defined on first use: it imports
  TensorFlow): the JPEG bytes as they are, or their pixels as a uint8 tensor."""
  import tensorflow_datasets as tfds
  raw = kind == "raw_tfds"
  image = (tfds.features.Tensor(shape=(256, 320, 3), dtype=np.uint8) if raw
           else tfds.features.Image(shape=(None, None, 3), encoding_format="jpeg"))

  def __init__(self, *, root: str = "", **kwargs):
    self.root = pathlib.Path(root)
    tfds.core.GeneratorBasedBuilder.__init__(self, **kwargs)

  def _info(self):
    return self.dataset_info_from_configs(features=tfds.features.FeaturesDict({
        "image": image, "label": tfds.features.ClassLabel(num_classes=10)}))

  def _split_generators(self, dl_manager):
    return {split: self._generate_examples(self.root / split) for split in ("train", "test")}

  def _generate_examples(self, folder: pathlib.Path):
    from PIL import Image
    for path in sorted(folder.glob("*/*.jpg")):
      pixels = np.asarray(Image.open(path).convert("RGB")) if raw else str(path)
      yield path.name, {"image": pixels, "label": int(path.parent.name[1:])}

  # TFDS names a builder after its class (JpegRecords: jpeg_records) as the class is made.
  name = "".join(word.title() for word in RECORDS[kind].split("_"))
  return type(name, (tfds.core.GeneratorBasedBuilder,), {
      "VERSION": tfds.core.Version("1.0.0"),
      "pkg_dir_path": pathlib.Path(__file__).parent,  # a builder outside a dataset package
      "__init__": __init__, "_info": _info, "_split_generators": _split_generators,
      "_generate_examples": _generate_examples})


def stream_rate(source_kind: str, root: str, pp: str, batches: int) -> dict:
  """Images/s of the training stream in this process (its cores as pinned by the caller)."""
  from runner import data
  if source_kind == "image_folder":
    source = data.open_source("image_folder", root=root)
  else:  # the prepared records (prepared_tfds), opened as any prepared TFDS dataset
    _records_builder(source_kind)  # registers its name with TFDS
    source = data.open_source(RECORDS[source_kind], data_dir=root)
  stream = data.train_batches(source, "train", pp, BATCH, seed=0)
  first = next(stream)  # pays for building the graph and filling the shuffle buffer
  start = time.perf_counter()
  for _ in range(batches):
    next(stream)
  seconds = time.perf_counter() - start
  return {"images_per_s": batches * BATCH / seconds, "cores": len(os.sched_getaffinity(0)),
          "image_dtype": str(first["image"].dtype),
          "bytes_per_image": first["image"].nbytes // BATCH}


def _pinned(cores: int, args: list[str]) -> dict:
  """Runs this module's --child mode in a process pinned to `cores` cores."""
  env = dict(os.environ, VMOE_BENCH_CORES=str(cores))
  proc = subprocess.run([sys.executable, "-m", "benchmarks.input_pipeline", "--child", *args],
                        capture_output=True, text=True, env=env, timeout=1800)
  if proc.returncode:
    raise RuntimeError(proc.stderr[-3000:])
  return json.loads(proc.stdout.strip().splitlines()[-1])


def uint8_against_float32_step(rounds: int, steps: int = 10) -> dict:
  """Per round, the bare step's ms on a float32 batch and on a batch of uint8 pixels with
  value_range(-1,1)'s rows (the step converts them), alternating."""
  import jax
  from benchmarks import train_step
  from runner.config.preprocessing import DEVICE_VALUE_RANGE
  from runner.models import build_model
  preset = train_step.PRESETS["tiny"]
  model = build_model(train_step.model_configs(preset, "float32")["vmoe"], preset["num_classes"])
  shape = (preset["image_size"], preset["image_size"], 3)
  runs = {}
  for kind in ("float32", "uint8"):
    step, state, batch = train_step.jitted_train_step(model, shape, preset["batch_size"],
                                                      preset["num_classes"])
    if kind == "uint8":
      rows = len(batch["image"])
      batch = {**batch, "image": np.random.default_rng(0).integers(0, 256, (rows, *shape),
                                                                   np.uint8),
               DEVICE_VALUE_RANGE: np.tile(np.float32([[-1, 2, 0, 255]]), (rows, 1))}
    runs[kind] = _Stepper(step, state, jax.device_put(batch))
    jax.block_until_ready(runs[kind]())  # compiles
  times = harness.interleaved_rounds_ms(runs, rounds=rounds, steps=steps)
  ratios = [u / f for u, f in zip(times["uint8"], times["float32"])]
  return {"float32_step_ms": times["float32"], "uint8_step_ms": times["uint8"],
          "uint8_over_float32_per_round": ratios,
          "uint8_over_float32": statistics.median(ratios)}


class _Stepper:
  """One train step per call on the same batch; the state is donated and replaced."""

  def __init__(self, step, state, batch):
    self.step, self.state, self.batch = step, state, batch

  def __call__(self):
    self.state, metrics = self.step(self.state, self.batch)
    return metrics["train/loss"]


def _pretrain_images_per_s(steps: int) -> float:
  """The images/s a whole `vmoe pretrain` of vmoe_tiny logs after `steps` steps in this process:
  the run's own rate from the end of its first step (compilation) to its last, its data stream,
  logging and bookkeeping included (always seed 0: compiled once here)."""
  from runner import cli
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="vmoe-loop-")) / "run"
  code = cli.main(["pretrain", f"workdir={workdir}", "model=vmoe_tiny", f"train.steps={steps}",
                   f"train.log_every_steps={steps}", "schedule.warmup_steps=0",
                   "eval.every_steps=0", "checkpoint.every_steps=0",
                   "logger.wandb.mode=disabled", "logger.progress=false", "logger.report=false",
                   "seed=0"])
  assert code == 0
  logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return next(m["train/images_per_s"] for m in logged if "train/images_per_s" in m)


def loop_against_bare_step(rounds: int, loop_steps: int = 40, steps: int = 10) -> dict:
  """Per round: the bare step's images/s (median of `steps` steps on one batch already on the
  device), then the loop's: a whole `vmoe pretrain` of `loop_steps` steps, its own logged
  images/s after its first step."""
  import jax
  from benchmarks import train_step
  preset = train_step.PRESETS["tiny"]  # vmoe_tiny: 32 px, batch 128, 8 experts on blocks 1, 3
  bare = train_step.prepare_train_step(train_step.model_configs(preset, "float32")["vmoe"], preset)
  _pretrain_images_per_s(2)  # compiles into the persistent cache, prepares the data
  loop, step = [], []
  for _ in range(rounds):
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      jax.block_until_ready(bare.run())
      times.append(time.perf_counter() - start)
    step.append(BATCH / statistics.median(times))
    loop.append(_pretrain_images_per_s(loop_steps))
  ratios = [a / b for a, b in zip(loop, step)]
  return {"bare_step_images_per_s": step, "loop_images_per_s": loop, "loop_steps": loop_steps,
          "loop_over_bare_per_round": ratios, "loop_over_bare": statistics.median(ratios)}


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything is written."""
  parser = arguments.Parser(prog="benchmarks.input_pipeline",
                            description=__doc__.split("\n\n")[0])
  available = len(os.sched_getaffinity(0))
  parser.add_argument("--images", default="2000",
                      help=f"JPEGs written (at least {MIN_IMAGES}: every class in both splits)")
  parser.add_argument("--batches", default="8",
                      help="timed batches of 128 per stream (at least 1)")
  parser.add_argument("--cores", default=None,
                      help=f"comma list, each from 1 to the {available} this process may use; "
                           "default 1 and all")
  parser.add_argument("--loop-rounds", default="3", help="0 skips the loop measurement")
  parser.add_argument("--step-rounds", default="5",
                      help="uint8 against float32 step rounds; 0 skips them")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--kind", default="image_folder", help=argparse.SUPPRESS)
  parser.add_argument("--root", default="", help=argparse.SUPPRESS)
  parser.add_argument("--pp", default="", help=argparse.SUPPRESS)
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.images = parser.number("--images", args.images, int, MIN_IMAGES)
  args.batches = parser.number("--batches", args.batches, int, 1)
  if args.cores is not None:
    args.cores = parser.numbers("--cores", args.cores, int, 1, available)
  args.loop_rounds = parser.number("--loop-rounds", args.loop_rounds, int, 0)
  args.step_rounds = parser.number("--step-rounds", args.step_rounds, int, 0)
  return args


def main(argv=None) -> None:
  args = parse(argv)
  if args.child:
    cores = int(os.environ.get("VMOE_BENCH_CORES", "0"))
    if cores:
      os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    print(json.dumps(stream_rate(args.kind, args.root, args.pp, args.batches)))
    return
  available = len(os.sched_getaffinity(0))
  cores = list(args.cores) if args.cores else sorted({1, available})
  record = {"machine": harness.machine(), "images": args.images, "size": SIZE, "batch": BATCH,
            "date": time.strftime("%Y-%m-%d"), "streams": {}}
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp) / "jpegs"
    write_jpegs(root, args.images)
    records = pathlib.Path(tmp) / "tfds"
    prepared_tfds(root, records)
    kinds = (("image_folder", root), ("tfds", records), ("raw_tfds", records))
    for (kind, where), (name, pp), n in itertools.product(kinds, PIPELINES.items(), cores):
      result = _pinned(n, ["--kind", kind, "--root", str(where), "--pp", pp,
                           "--batches", str(args.batches)])
      key = f"{kind}/{name}/{n}_cores"
      record["streams"][key] = result
      print(f"{key:<40} {result['images_per_s']:8.0f} images/s "
            f"({result['images_per_s'] / n:6.0f} per core)", flush=True)
  # Every built-in declares its keys before this process makes a config (the step measurement
  # makes some; the pretrain runs need every key).
  builtins.register()
  if args.step_rounds:
    record["uint8_step"] = uint8_against_float32_step(args.step_rounds)
    print(f"train step on uint8 / on float32 images (vmoe_tiny, batch 128): "
          f"{record['uint8_step']['uint8_over_float32']:.3f} (per round "
          f"{', '.join(f'{r:.3f}' for r in record['uint8_step']['uint8_over_float32_per_round'])})")
  if args.loop_rounds:
    record["loop"] = loop_against_bare_step(args.loop_rounds)
    print(f"vmoe pretrain / bare step (vmoe_tiny, batch 128): "
          f"{record['loop']['loop_over_bare']:.3f} (per round "
          f"{', '.join(f'{r:.3f}' for r in record['loop']['loop_over_bare_per_round'])})")
  print(f"wrote {harness.write('input_pipeline', record, record=args.record)}")


if __name__ == "__main__":
  main()
