"""tf.data input pipelines: an endless, deterministic, resumable training stream and padded eval batches.

Training stream: the split is read in shards (one per process by default, `data.num_shards`),
and epoch e of a shard is that shard shuffled with seed (seed, e). The stream is a pure function
of (seed, position), where position counts the examples this process has consumed, so resuming
at a checkpointed position replays exactly what an uninterrupted run would have read,
augmentations included (each example's random ops are seeded from its shard and position).
Resuming skips at most one epoch of (still encoded, so cheap) records.
"""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import tensorflow as tf

from runner.data import pp_ops
from runner.data.sources import Source

# Cache raw records in memory for splits this small (encoded images: CIFAR-10 is ~130 MB).
_CACHE_MAX_EXAMPLES = 200_000


def _finish(source: Source, pp, spec: str) -> callable:
  """User preprocessing, then one/multi-hot `labels` unless the spec made them, then drop extras."""
  def fn(example):
    example = pp(example)
    image = example.get(source.image_key)
    if image is None or image.dtype == tf.string:
      raise pp_ops.PreprocessError(
          f"preprocessing {spec!r} leaves no decoded image under {source.image_key!r}; start it "
          "with decode (e.g. 'decode(3)|resize(224)|value_range(-1,1)') and keep the image.")
    if "labels" not in example:
      if source.label_key not in example:
        raise pp_ops.PreprocessError(f"preprocessing {spec!r} removed the label "
                                     f"{source.label_key!r}; keep it or produce 'labels'.")
      example = pp_ops.get_onehot(source.num_classes, key=source.label_key)(example)
    return {"image": tf.cast(image, tf.float32), "labels": example["labels"]}
  return fn


def _with_rng(seed: int, process_index: int = 0):
  """Attaches the example's stateless seed: (run seed and process, position in the stream)."""
  def fn(position, example):
    example["_rng"] = tf.stack([tf.constant(seed + 1_000_003 * process_index, tf.int64), position])
    return example
  return fn


# Label noise corrupts the same examples in every run (and every member of an ensemble): a
# property of the dataset variant, not of the run's seed.
LABEL_NOISE_SEED = 20_221_107


def noisy_labels(source: Source, fraction: float):
  """A fixed `fraction` of the examples, chosen by their index, get a uniformly random class
  (possibly their own): the label-noise variant of a dataset (evaluation labels stay clean)."""
  key = source.label_key

  def fn(example):
    index = tf.cast(example["_index"], tf.int32)
    seed = tf.stack([tf.constant(LABEL_NOISE_SEED, tf.int32), index])
    flip = tf.random.stateless_uniform([], seed=seed) < fraction
    random_class = tf.random.stateless_uniform([], seed=seed + 1, minval=0,
                                               maxval=source.num_classes, dtype=tf.int32)
    label = example[key]
    example = dict(example)
    example[key] = tf.where(flip, tf.cast(random_class, label.dtype), label)
    del example["_index"]
    return example
  return fn


def train_batches(source: Source, split: str, pp: str, batch_size: int, *, seed: int,
                  start: int = 0, shuffle_buffer: int = 50_000, process_index: int = 0,
                  process_count: int = 1, label_noise: float = 0.0,
                  num_shards: int | None = None) -> Iterator[dict[str, np.ndarray]]:
  """Endless batches of this process (`batch_size` rows) from example position `start` (counted
  per process) onwards.

  The split is read in `num_shards` contiguous shards (default: one per process), each shuffled
  and augmented on its own, and every global batch is the shards' equal parts in shard order;
  a process reads its own consecutive shards. So a run's batches depend on the number of shards,
  not of processes: `num_shards=2` in one process gives the batches of a 2-process job.
  Each batch dict holds `image` (B, H, W, C) float32 and `labels` (B, num_classes) float32.
  `label_noise` replaces that fraction of the training labels by random classes (`noisy_labels`).
  """
  shards = num_shards or process_count
  if shards % process_count or batch_size * process_count % shards:
    raise ValueError(f"data.num_shards={shards} must be a multiple of the {process_count} "
                     f"processes and divide the batch of {batch_size * process_count}")
  mine = shards // process_count  # consecutive shards of this process
  streams = [_shard_stream(source, split, pp, batch_size // mine, seed=seed,
                           start=start // mine, shuffle_buffer=shuffle_buffer,
                           shard=process_index * mine + i, shards=shards,
                           label_noise=label_noise) for i in range(mine)]
  if mine == 1:
    return streams[0].prefetch(2).as_numpy_iterator()
  ds = tf.data.Dataset.zip(tuple(streams)).map(
      lambda *parts: {k: tf.concat([p[k] for p in parts], 0) for k in parts[0]})
  return ds.prefetch(2).as_numpy_iterator()


def _shard_stream(source: Source, split: str, pp: str, batch_size: int, *, seed: int, start: int,
                  shuffle_buffer: int, shard: int, shards: int, label_noise: float
                  ) -> tf.data.Dataset:
  """Endless batches of one shard of the split from position `start` (counted in the shard)."""
  preprocess = _finish(source, pp_ops.parse(pp), pp)
  if label_noise:
    raw = source.read(split, shard, shards, with_index=True).map(
        noisy_labels(source, label_noise))
  else:
    raw = source.read(split, shard, shards)
  num = source.num_examples(split) // shards
  if num < batch_size:
    raise ValueError(f"split {split!r} of {source.name!r} has {num} examples per shard, fewer "
                     f"than one batch of {batch_size}")
  if num <= _CACHE_MAX_EXAMPLES:
    raw = raw.cache()
  buffer = min(shuffle_buffer, num)
  first_epoch, offset = divmod(start, num)

  def epoch(e):
    return raw.shuffle(buffer, seed=seed * 1_000_003 + e, reshuffle_each_iteration=False)

  ds = tf.data.Dataset.range(first_epoch, 1 << 62).flat_map(epoch).skip(offset)
  ds = tf.data.Dataset.zip(tf.data.Dataset.range(start, 1 << 62), ds)
  ds = ds.map(_with_rng(seed, shard)).map(preprocess, num_parallel_calls=tf.data.AUTOTUNE,
                                          deterministic=True)
  return ds.batch(batch_size, drop_remainder=True)


def eval_batches(source: Source, split: str, pp: str, batch_size: int, *, process_index: int = 0,
                 process_count: int = 1, cache: bool = True) -> tf.data.Dataset:
  """A re-iterable dataset of full-size batches; `_mask` marks real examples, the rest is padding.

  Every example of the split is read by exactly one process, and every process yields the same
  number of batches (the collective eval step needs that), padding with masked-out batches.
  `cache` keeps the raw split in memory for repeated evaluation during training; a one-pass
  evaluation turns it off so that memory does not grow with the split.
  """
  preprocess = _finish(source, pp_ops.parse(pp), pp)
  raw = source.read(split, process_index, process_count, drop_remainder=False)
  total = source.num_examples(split)
  if cache and total <= _CACHE_MAX_EXAMPLES:
    raw = raw.cache()
  ds = tf.data.Dataset.zip(tf.data.Dataset.range(1 << 62), raw).map(_with_rng(0))
  ds = ds.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.map(lambda ex: {**ex, "_mask": tf.constant(True)})
  ds = ds.padded_batch(batch_size).map(lambda b: _pad_batch(b, batch_size))
  num_batches = math.ceil(math.ceil(total / process_count) / batch_size)
  empty = ds.take(1).map(lambda b: {k: tf.zeros_like(v) for k, v in b.items()}).repeat()
  return ds.concatenate(empty).take(num_batches).prefetch(2)


def _pad_batch(batch, batch_size):
  """Pads the last (short) batch with zeros so that every batch has the same shape."""
  n = tf.shape(batch["_mask"])[0]
  return {k: tf.concat([v, tf.zeros(tf.concat([[batch_size - n], tf.shape(v)[1:]], 0), v.dtype)], 0)
          for k, v in batch.items()}


def image_shape(source: Source, split: str, pp: str) -> tuple[int, ...]:
  """Shape of one preprocessed image, found by running the pipeline on one example."""
  preprocess = _finish(source, pp_ops.parse(pp), pp)
  ds = tf.data.Dataset.zip(tf.data.Dataset.range(1), source.read(split).take(1))
  example = next(iter(ds.map(_with_rng(0)).map(preprocess)))
  return tuple(example["image"].shape)
