"""Contrastive loss memory: the B x B logits and HET-XL's samples, chunked vs materialised at once.

The issue's requirement: "the batch x batch logits and HET-XL's samples never materialise more
than the loss needs — measure peak memory at batch 512". For B pairs, embedding width E and S MC
samples per example (HET-XL, the HET-XL paper's Eq. 8), the loss + gradient of
`runner.losses.contrastive.softmax_loss` (which takes the samples `chunk` at a time in a
rematerialised scan, so only one chunk's c x B x B logits exist per direction) is compiled next to
a naive transcription that builds all S x B x B logits of both directions at once. Memory is XLA's
own accounting of each compiled program (`memory_analysis()`: arguments + outputs + temporaries -
aliased buffers; deterministic, the same on every run); optionally the peak RSS of one step run
in a fresh process (`--rss-batches`), a measurement of the same thing through the allocator; and
each candidate's time per loss + gradient step, the candidates of a batch size alternating round
by round in one process (medians). Analytic reference: one chunk's logits are c·B²·4 bytes per
direction (float32), S·B²·4 for the naive loss.

Then the whole contrastive train step (runner.train.step.make_train_step with
objectives.contrastive_pairs, Adam) of a tiny two-tower model at batch 512 — the demo's vmoe_tiny
at 28 px as the image tower, text_tiny as the text tower — DET vs HET-XL, LiT (image tower
locked) and from scratch: its memory_analysis, to see how much of a step the loss is.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import arguments, harness
from runner.losses import contrastive
from runner.models.contrastive import normalize
from runner.models.size import count_params

EMBED = 128  # objective.embedding_dim's default: the width both towers are projected to
CHUNK = 8  # the chunk of MC samples the step rows were measured with (training's default is 1)
MB = 2**20


def naive_loss(zimg, ztxt, scale, image_samples, text_samples):
  """The symmetric softmax loss with all S x B x B logits of each direction at once (Eq. 8 read
  literally): the reference the chunked loss must match and beat in memory."""
  def direction(queries, keys):  # queries (B, S, E): noisy, keys (B, E): the other tower's
    b, s, _ = queries.shape
    logits = scale * jnp.einsum("bse,je->bsj", queries, keys)  # (B, S, B): every sample at once
    log_p = jax.nn.log_softmax(logits, axis=-1)
    own = log_p[jnp.arange(b), :, jnp.arange(b)]  # (B, S): each query's own pair
    return -(jax.nn.logsumexp(own, axis=1) - math.log(s))
  return 0.5 * (direction(image_samples, ztxt).mean() + direction(text_samples, zimg).mean())


def chunked_loss(chunk: int):
  def loss(zimg, ztxt, scale, image_samples, text_samples):
    return contrastive.softmax_loss(zimg, ztxt, scale, image_samples=image_samples,
                                    text_samples=text_samples, chunk=chunk)[0]
  return loss


def det_loss(zimg, ztxt, scale, image_samples, text_samples):
  """The deterministic loss (Eq. 6): no samples, one B x B logit matrix per direction."""
  del image_samples, text_samples
  return contrastive.softmax_loss(zimg, ztxt, scale)[0]


def inputs(batch: int, samples: int, embed: int = EMBED, seed: int = 0):
  rng = np.random.default_rng(seed)
  unit = lambda *shape: np.asarray(normalize(  # noqa: E731
      jnp.asarray(rng.standard_normal(shape), jnp.float32)))
  zimg, ztxt = unit(batch, embed), unit(batch, embed)
  noise = lambda z: z[:, None] + 0.1 * rng.standard_normal((batch, samples, embed))  # noqa: E731
  return (jnp.asarray(zimg), jnp.asarray(ztxt), jnp.float32(10.0),
          jnp.asarray(noise(zimg), jnp.float32), jnp.asarray(noise(ztxt), jnp.float32))


def candidates(samples: int, chunks: list[int]) -> dict:
  out = {"det": det_loss} if samples == 1 else {}
  for c in chunks:
    if c < samples or c == chunks[0]:  # a chunk >= S is the unchunked loss: measured once
      out[f"chunked c={min(c, samples)}"] = chunked_loss(c)
  out["naive"] = naive_loss
  return out


def compile_loss(fn, args):
  grad = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3, 4)))
  return grad, grad.lower(*args).compile()


def memory(compiled) -> dict:
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)
  return {"peak_mb": peak / MB, "temp_mb": m.temp_size_in_bytes / MB,
          "argument_mb": m.argument_size_in_bytes / MB, "output_mb": m.output_size_in_bytes / MB}


def _rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def rss_child(batch: int, samples: int, name: str, chunks: list[int]) -> None:
  """In a fresh process: compile one candidate, then run it once while a thread samples the
  resident set every 0.2 ms: the growth of RSS over what compiling left behind, the memory the
  run touched (the kernel's ru_maxrss cannot see it: compilation peaks higher). With a GPU, the
  device's own peak instead."""
  args = inputs(batch, samples)
  _, compiled = compile_loss(candidates(samples, chunks)[name], args)
  jax.block_until_ready(args)
  base, peak, done = _rss_mb(), [0.0], threading.Event()

  def sample():
    while not done.is_set():
      peak[0] = max(peak[0], _rss_mb())
      time.sleep(2e-4)
  thread = threading.Thread(target=sample)
  thread.start()
  jax.block_until_ready(compiled(*args))
  done.set()
  thread.join()
  stats = jax.devices()[0].memory_stats() or {}
  print(json.dumps({"rss_growth_mb": max(peak[0], _rss_mb()) - base,
                    "device_peak_mb": stats.get("peak_bytes_in_use", 0) / MB or None}))


def measured_rss(batch: int, samples: int, name: str, chunks: list[int]) -> dict:
  cmd = [sys.executable, "-m", "benchmarks.contrastive_memory", "--rss-child",
         f"{batch},{samples},{name}", "--chunks", ",".join(map(str, chunks))]
  out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
  return json.loads(out.stdout.strip().splitlines()[-1])


def loss_rows(batches, samples_list, chunks, rounds, rss_batches, time_limit_mb) -> list[dict]:
  rows = []
  for batch in batches:
    timed, prepared = {}, {}
    for samples in samples_list:
      args = inputs(batch, samples)
      reference = None
      for name, fn in candidates(samples, chunks).items():
        _, compiled = compile_loss(fn, args)
        value = float(compiled(*args)[0])
        if name != "det":
          reference = value if reference is None else reference
        row = {"batch": batch, "samples": samples, "embed": EMBED, "impl": name.split()[0],
               "chunk": int(name.split("=")[1]) if "=" in name else (
                   samples if name == "naive" else None),
               "loss": value, **memory(compiled),
               # Analytic: the float32 logits of one chunk (c x B x B) in one direction.
               "logits_chunk_mb": (samples if name == "naive" else int(name.split("=")[1])
                                   if "=" in name else 1) * batch * batch * 4 / MB}
        row["loss_vs_naive"] = None if name == "det" else abs(value - reference)
        if batch in rss_batches:
          row.update(measured_rss(batch, samples, name, chunks))
        key = f"S={samples} {name}"
        rows.append(row)
        prepared[key] = row
        if row["peak_mb"] <= time_limit_mb:
          timed[key] = (lambda c=compiled, a=args: c(*a)[0])
        print(f"B={batch:<5} {key:<22} peak {row['peak_mb']:9.1f} MB, temp {row['temp_mb']:9.1f} "
              f"MB (one chunk's logits {row['logits_chunk_mb']:7.1f} MB), loss {value:.6f}"
              + (f", RSS +{row['rss_growth_mb']:.1f} MB" if "rss_growth_mb" in row else ""),
              flush=True)
    # The naive and chunked losses must agree to float32 rounding.
    for row in rows:
      if row["batch"] == batch and row["loss_vs_naive"] is not None:
        assert row["loss_vs_naive"] < 1e-4 * max(1.0, abs(row["loss"])), row
    per_round = harness.interleaved_rounds_ms(timed, rounds=rounds, steps=3)
    for key, row in prepared.items():
      row["step_ms"] = float(np.median(per_round[key])) if key in per_round else None
      row["step_ms_per_round"] = per_round.get(key)
      if row["step_ms"] is not None:
        print(f"B={batch:<5} {key:<22} {row['step_ms']:8.2f} ms per loss + gradient", flush=True)
  return rows


def train_step_rows(batch: int, rounds: int) -> list[dict]:
  """The whole contrastive train step of the demo-sized two towers at `batch`, DET vs HET-XL."""
  import dataclasses

  from runner.config.schema import (HeadConfig, HeadType, Objective, ObjectiveConfig,
                                    TextConfig)
  from runner.models import model_config
  from runner.models.contrastive import build_two_towers
  from runner.train import objectives, optimizers, schedules, state as state_lib
  from runner.train.step import make_train_step

  image = (28, 28, 3)
  variants = {  # name: (head, MC samples, LiT, chunk of the loss)
      "DET, LiT": ("det", 1, True, CHUNK), "HET-XL S=1, LiT": ("het_xl", 1, True, CHUNK),
      "HET-XL S=64, LiT": ("het_xl", 64, True, CHUNK),
      "HET-XL S=64 c=1, LiT": ("het_xl", 64, True, 1),
      "DET, from scratch": ("det", 1, False, CHUNK),
      "HET-XL S=1, from scratch": ("het_xl", 1, False, CHUNK)}
  rows, fns = [], {}
  for name, (head, samples, locked, chunk) in variants.items():
    config = dataclasses.replace(model_config("vmoe_tiny"), image_size=28)
    if head == "het_xl":  # conf/objective/contrastive.yaml's HET-XL: R = 15, not param.-efficient
      config = dataclasses.replace(config, head=HeadConfig(
          type=HeadType.het_xl, num_factors=15, parameter_efficient=False,
          train_mc_samples=samples, eval_mc_samples=samples))
    model = build_two_towers(config, TextConfig(), ObjectiveConfig(name=Objective.contrastive), 259,
                             lock_image=locked)
    params, _ = state_lib.init_params(model, image, seed=0)
    schedule = schedules.make_schedule("linear", 1e-3, 10_000, 100)
    tx = optimizers.make_optimizer("adam", schedule, params, grad_clip_norm=1.0,
                                   frozen="image/.*" if locked else None)
    state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                 opt_state=tx.init(params))
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 259, (batch, TextConfig().max_length))
    batch_data = {"image": jnp.asarray(rng.standard_normal((batch,) + image), jnp.float32),
                  "tokens": jnp.asarray(tokens, jnp.int32)}
    step = jax.jit(make_train_step(
        model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01,
        objective=objectives.contrastive_pairs(model, loss="softmax", aux_loss_weight=0.01,
                                               chunk=chunk)), donate_argnums=0)
    compiled = step.lower(state, batch_data).compile()
    row = {"batch": batch, "variant": name, "head": head, "samples": samples, "lit": locked,
           "chunk": min(chunk, samples),
           "params": count_params(params), **memory(compiled)}
    box = {"state": state}

    def train(c=compiled, b=box, d=batch_data):
      b["state"], metrics = c(b["state"], d)
      return metrics["train/loss"]
    for _ in range(2):
      jax.block_until_ready(train())
    fns[name] = train
    rows.append(row)
    print(f"train step B={batch} {name:<26} peak {row['peak_mb']:8.1f} MB, temp "
          f"{row['temp_mb']:8.1f} MB, {row['params']:,} parameters", flush=True)
  per_round = harness.interleaved_rounds_ms(fns, rounds=rounds, steps=2)
  for row in rows:
    row["step_ms"] = float(np.median(per_round[row["variant"]]))
    row["step_ms_per_round"] = per_round[row["variant"]]
    print(f"train step B={batch} {row['variant']:<26} {row['step_ms']:8.1f} ms", flush=True)
  return rows


def _text_length() -> int:
  from runner.config.schema import TextConfig
  return TextConfig().max_length


def parse(argv=None) -> argparse.Namespace:
  """The arguments, each checked: a bad one exits (status 2) before anything compiles."""
  parser = arguments.Parser(prog="benchmarks.contrastive_memory",
                            description=__doc__.split("\n")[0])
  parser.add_argument("--batches", default="128,512,1024", help="batch sizes B, each >= 1")
  parser.add_argument("--samples", default="1,8,64", help="MC samples S, each >= 1")
  parser.add_argument("--chunks", default=f"{CHUNK},1", help="chunk sizes of the chunked loss, each >= 1; "
                      "the first is the default of objectives.contrastive_pairs")
  parser.add_argument("--rounds", default="5", help="alternating rounds (at least 1)")
  parser.add_argument("--rss-batches", default="512", help="batch sizes whose candidates also "
                      "run once in a fresh process for their peak RSS ('' : none)")
  parser.add_argument("--time-limit-mb", default="4096",
                      help="time only programs whose XLA peak is at most this (>= 0)")
  parser.add_argument("--train-batch", default="512", help="0: skip the train step")
  parser.add_argument("--rss-child", help=argparse.SUPPRESS)
  harness.add_record_option(parser)
  args = parser.parse_args(argv)
  args.batches = list(parser.numbers("--batches", args.batches, int, 1))
  args.samples = list(parser.numbers("--samples", args.samples, int, 1))
  args.chunks = list(parser.numbers("--chunks", args.chunks, int, 1))
  args.rounds = parser.number("--rounds", args.rounds, int, 1)
  args.rss_batches = (list(parser.numbers("--rss-batches", args.rss_batches, int, 1))
                      if args.rss_batches.strip() else [])
  args.time_limit_mb = parser.number("--time-limit-mb", args.time_limit_mb, float, 0)
  args.train_batch = parser.number("--train-batch", args.train_batch, int, 0)
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  chunks = args.chunks
  if args.rss_child:
    batch, samples, name = args.rss_child.split(",", 2)
    rss_child(int(batch), int(samples), name, chunks)
    return {}
  rows = loss_rows(args.batches, args.samples, chunks, args.rounds, args.rss_batches,
                   args.time_limit_mb)
  steps = train_step_rows(args.train_batch, args.rounds) if args.train_batch else []
  record = {"machine": harness.machine(), "embed": EMBED, "chunk_default": CHUNK,
            "loss_rows": rows, "train_step_rows": steps,
            "train_step_model": "vmoe_tiny at 28 px + text_tiny, Adam",
            "text_max_length": _text_length()}
  print(f"written to {harness.write('contrastive_memory', record, record=args.record)}")
  return record


if __name__ == "__main__":
  main()
