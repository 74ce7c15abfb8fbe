"""Heteroscedastic heads: peak memory and step time of a `vit_tiny` train step, DET vs HET vs HET-XL.

For S = 16, 256 and 1000 MC samples and K = 10 and 1000 classes, the compiled train step's
memory from XLA's own accounting (`memory_analysis()`: arguments + outputs + temporaries - aliased
buffers; on CPU this is the working set of the step) and its time, the heads alternating round by
round in one process. HET and HET-XL materialise B x S x K tensors (and HET-XL B x S x D); with
`model.head.mc_chunk_size` the samples are computed a chunk at a time under rematerialisation,
so memory follows the chunk, not S: measured for S = 1000 with chunks of 64.
"""
from __future__ import annotations

import argparse
import dataclasses

import jax

from benchmarks import arguments, harness, train_step
from runner.config.schema import HeadConfig, HeadType
from runner.models import build_model, model_config
from runner.models.size import count_params

BATCH, IMAGE = 128, (32, 32, 3)


def _config(head: str, samples: int, chunk: int | None):
  config = model_config("vit_tiny")
  if head == "det":
    return config
  return dataclasses.replace(config, head=HeadConfig(
      type=HeadType(head), num_factors=50, parameter_efficient=True, train_mc_samples=samples,
      eval_mc_samples=samples, temperature=None, mc_chunk_size=chunk))


def _prepare(config, classes: int):
  model = build_model(config, classes)
  compiled, state, batch = train_step.compiled_train_step(model, IMAGE, BATCH, classes)
  memory = compiled.memory_analysis()
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  params = count_params(state.params)  # before the first step donates the state
  box = {"state": state}

  def train():
    box["state"], metrics = compiled(box["state"], batch)
    return metrics["train/loss"]
  for _ in range(2):
    jax.block_until_ready(train())
  return train, peak, memory.temp_size_in_bytes, params


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything compiles."""
  parser = arguments.Parser(prog="benchmarks.het_head", description=__doc__.split("\n")[0])
  parser.add_argument("--samples", default="16,256,1000", help="MC samples S, each >= 1")
  parser.add_argument("--classes", default="10,1000", help="classes K, each >= 2")
  parser.add_argument("--chunk", default="64", help="MC samples per chunk (>= 1)")
  parser.add_argument("--rounds", default="3", help="alternating rounds (at least 1)")
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.samples = parser.numbers("--samples", args.samples, int, 1)
  args.classes = parser.numbers("--classes", args.classes, int, 2)
  args.chunk = parser.number("--chunk", args.chunk, int, 1)
  args.rounds = parser.number("--rounds", args.rounds, int, 1)
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  rows = []
  for classes in args.classes:
    variants = {"det": ("det", 0, None)}
    for samples in args.samples:
      for head in ("het", "het_xl"):
        variants[f"{head} S={samples}"] = (head, samples, None)
    top = max(args.samples)
    for head in ("het", "het_xl"):
      variants[f"{head} S={top} chunk={args.chunk}"] = (head, top, args.chunk)
    prepared = {name: _prepare(_config(*v), classes) for name, v in variants.items()}
    times = harness.interleaved_median_ms({n: p[0] for n, p in prepared.items()},
                                          rounds=args.rounds, steps=2)
    for name, (head, samples, chunk) in variants.items():
      _, peak, temp, params = prepared[name]
      row = {"classes": classes, "head": head, "samples": samples, "chunk": chunk,
             "step_ms": times[name], "peak_mb": peak / 2**20, "temp_mb": temp / 2**20,
             "params": params}
      rows.append(row)
      print(f"K={classes:<5} {name:<24} step {row['step_ms']:8.1f} ms, peak {row['peak_mb']:8.1f} "
            f"MB (temp {row['temp_mb']:8.1f} MB), {params:,} parameters", flush=True)
  record = {"machine": harness.machine(), "batch": BATCH, "model": "vit_tiny", "rows": rows}
  print(f"written to {harness.write('het_head', record, record=args.record)}")
  return record


if __name__ == "__main__":
  main()
