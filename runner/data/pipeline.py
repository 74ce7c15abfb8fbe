"""tf.data input pipelines: an endless, deterministic, resumable training stream and padded eval
batches. The training stream is a pure function of (seed, position), position counting the examples
this process consumed: resuming at a checkpointed position replays what an uninterrupted run would
have read, augmentations included, skipping at most one epoch of (still encoded, cheap) records.
Image-text data adds a caption's `tokens` (random in training, else the first)."""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import numpy as np

from runner.config import preprocessing
from runner.data import pp_ops
from runner.data.sources import DataError, Source, text_of
from runner.data.tensorflow_on_use import tf
from runner.data.tokenizers import PAD, Tokenizer

_CACHE_MAX_EXAMPLES = 200_000  # raw records of splits this small are cached (CIFAR-10: ~130 MB)
_CAPTION_SEED = 7_919  # folded into an example's seed to pick its caption, apart from augmentations


@dataclasses.dataclass(frozen=True)
class TextSpec:
  """Where an example's caption is (`key`, '/' for nested features) and how it becomes tokens."""
  key: str
  tokenizer: Tokenizer
  max_length: int


def _finish(source: Source, spec: str, text: TextSpec | None = None,
            train: bool = False) -> callable:
  """User preprocessing, then one/multi-hot `labels` unless the spec made them, extras dropped. A
  spec ending in value_range on a uint8 image leaves that op to the jitted step
  (runner/models/inputs.py); other images leave as float32. With `text`, the caption too."""
  ops = preprocessing.build(spec)
  tail = preprocessing.device_tail(spec)
  on_device = tail is not None and tail["key"] == source.image_key
  host, last = (ops[:-1], ops[-1]) if on_device else (ops, None)

  parts = preprocessing.parts(spec)  # what each op of `ops` was built from

  def fn(example):
    if text:
      caption = _pick_caption(text_of(example, text.key), example["_rng"], train)
    for part, op in zip(parts, host):
      try:
        example = op(example)
      except (ValueError, TypeError, KeyError) as e:  # e.g. a crop larger than the image
        why = f"no feature {e} (an op before removed it)" if isinstance(e, KeyError) else e
        image = example.get(source.image_key)
        encoded = image is not None and image.dtype == tf.string
        raise pp_ops.PreprocessError(
            f"preprocessing {spec!r} fails at {part}: {str(why).rstrip('.')}."
            + (" The image is still encoded there: start with decode, e.g. "
               "'decode(3)|resize(224)|value_range(-1,1)'." if encoded else ""))
    image = example.get(source.image_key)
    if image is None or image.dtype == tf.string:
      raise pp_ops.PreprocessError(
          f"preprocessing {spec!r} leaves no decoded image under {source.image_key!r}; start it "
          "with decode (e.g. 'decode(3)|resize(224)|value_range(-1,1)') and keep the image.")
    if last is not None and image.dtype == tf.uint8:
      vmin, vmax, in_min, in_max = (float(tail[n]) for n in ("vmin", "vmax", "in_min", "in_max"))
      out = {"image": image, preprocessing.DEVICE_VALUE_RANGE: tf.constant(
          [vmin, vmax - vmin, in_min, in_max - in_min], tf.float32)}
    else:
      if last is not None:
        example = last(example)
      out = {"image": tf.cast(example[source.image_key], tf.float32)}
    if text:  # tokenized as batches are read (_tokenized)
      out["_caption"] = caption
    if source.num_classes:  # (train_batches and eval_batches check there are classes, or text)
      if "labels" not in example:
        if source.label_key not in example:
          raise pp_ops.PreprocessError(f"preprocessing {spec!r} removed the label "
                                       f"{source.label_key!r}; keep it or produce 'labels'.")
        example = pp_ops.get_onehot(source.num_classes, key=source.label_key)(example)
      out["labels"] = example["labels"]
    return out
  return fn


def _map(ds: tf.data.Dataset, preprocess, **options) -> tf.data.Dataset:
  """ds.map(preprocess): a PreprocessError raised as tf.data traces it is raised as it was, not as
  autograph's copy (the copy's message starts with where in the code it was raised)."""
  try:
    return ds.map(preprocess, **options)
  except pp_ops.PreprocessError as e:
    raise (e.__context__ if isinstance(e.__context__, pp_ops.PreprocessError) else e) from None


def _pick_caption(captions: tf.Tensor, rng: tf.Tensor, train: bool) -> tf.Tensor:
  """The example's caption; of several (a 1-D tensor), a random one in training, else the first."""
  if captions.shape.rank == 0:
    return captions
  if not train:
    return captions[0]
  seed = tf.random.experimental.stateless_fold_in(rng, _CAPTION_SEED)
  index = tf.random.stateless_uniform([], seed=seed, maxval=tf.shape(captions)[0], dtype=tf.int32)
  return captions[index]


def _tokenized(batches: Iterator[dict], text: TextSpec) -> Iterator[dict[str, np.ndarray]]:
  """Numpy batches with each `_caption` as `tokens` (B, max_length) int32, zero in padding rows;
  tokenized in the reading thread, as a Python tokenizer in tf.data (tf.numpy_function) deadlocks
  when an iterator with calls in flight is dropped (its destructor waits, holding the GIL)."""
  for batch in batches:
    captions = batch.pop("_caption")
    tokens = np.stack([text.tokenizer.encode(c.decode("utf-8", "replace"), text.max_length)
                       for c in captions])
    if "_mask" in batch:
      tokens[~batch["_mask"]] = PAD
    batch["tokens"] = tokens
    yield batch


class TokenizedBatches:
  """A re-iterable dataset of evaluation batches with tokens (`as_numpy_iterator`, as tf.data)."""

  def __init__(self, batches: tf.data.Dataset, text: TextSpec):
    self.batches, self.text = batches, text

  def as_numpy_iterator(self) -> Iterator[dict[str, np.ndarray]]:
    return _tokenized(self.batches.as_numpy_iterator(), self.text)


def _check_labels(source: Source, text: TextSpec | None) -> None:
  """A dataset without classes (image-caption pairs) trains and evaluates only with its text."""
  if not source.num_classes and not text:
    raise DataError(f"dataset {source.name!r} has no class labels, only image-caption pairs: "
                    "train it with objective=contrastive, or choose a dataset with classes.")


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
  def fn(example):
    index = tf.cast(example["_index"], tf.int32)
    seed = tf.stack([tf.constant(LABEL_NOISE_SEED, tf.int32), index])
    flip = tf.random.stateless_uniform([], seed=seed) < fraction
    random_class = tf.random.stateless_uniform([], seed=seed + 1, minval=0,
                                               maxval=source.num_classes, dtype=tf.int32)
    label = example[source.label_key]
    example = dict(example)
    example[source.label_key] = tf.where(flip, tf.cast(random_class, label.dtype), label)
    del example["_index"]
    return example
  return fn


def train_batches(source: Source, split: str, pp: str, batch_size: int, *, seed: int,
                  start: int = 0, shuffle_buffer: int = 50_000, process_index: int = 0,
                  process_count: int = 1, label_noise: float = 0.0,
                  num_shards: int | None = None, cache: bool | None = None,
                  text: TextSpec | None = None) -> Iterator[dict[str, np.ndarray]]:
  """Endless batches of this process (`batch_size` rows) from example position `start` (counted per
  process) onwards. The split is read in `num_shards` contiguous shards (default: one per process),
  each shuffled and augmented on its own; every global batch is the shards' equal parts in shard
  order, each process reading consecutive shards. A run's batches thus depend on the number of
  shards, not of processes (`num_shards=2` in one process gives a 2-process job's batches). A batch
  holds `image` (B, H, W, C) (uint8 if the spec ends in value_range) and `labels` (B, num_classes)
  float32; with `text`, also `tokens` (B, max_length) int32, `labels` only if there are classes."""
  _check_labels(source, text)
  if label_noise and not source.num_classes:
    raise DataError(f"data.label_noise={label_noise} replaces training labels by random classes, "
                    f"but dataset {source.name!r} has no class labels; leave it at 0.")
  shards = num_shards or process_count
  if shards % process_count or batch_size * process_count % shards:
    raise ValueError(f"data.num_shards={shards} must be a multiple of the {process_count} "
                     f"processes and divide the batch of {batch_size * process_count}")
  mine = shards // process_count  # consecutive shards of this process
  streams = [_shard_stream(source, split, pp, batch_size // mine, seed=seed, start=start // mine,
                           shuffle_buffer=shuffle_buffer, shard=process_index * mine + i,
                           shards=shards, label_noise=label_noise, cache=cache, text=text)
             for i in range(mine)]
  if mine == 1:
    ds = streams[0]
  else:
    ds = tf.data.Dataset.zip(tuple(streams)).map(
        lambda *parts: {k: tf.concat([p[k] for p in parts], 0) for k in parts[0]})
  batches = ds.prefetch(2).as_numpy_iterator()
  return _tokenized(batches, text) if text else batches


def _shard_stream(source: Source, split: str, pp: str, batch_size: int, *, seed: int, start: int,
                  shuffle_buffer: int, shard: int, shards: int, label_noise: float,
                  cache: bool | None = None, text: TextSpec | None = None) -> tf.data.Dataset:
  """Endless batches of one shard of the split from position `start` (counted in the shard)."""
  preprocess = _finish(source, pp, text, train=True)
  raw = source.read(split, shard, shards, with_index=bool(label_noise))
  if label_noise:
    raw = raw.map(noisy_labels(source, label_noise))
  num = source.num_examples(split) // shards
  if num < batch_size:  # the training task checks this first, naming the keys (tasks/fit.py)
    raise DataError(f"split {split!r} of {source.name!r} has {num} examples per shard, fewer "
                    f"than one batch of {batch_size}")
  if cache or (cache is None and num <= _CACHE_MAX_EXAMPLES):
    raw = raw.cache()
  buffer = min(shuffle_buffer, num)
  first_epoch, offset = divmod(start, num)

  def epoch(e):
    return raw.shuffle(buffer, seed=seed * 1_000_003 + e, reshuffle_each_iteration=False)

  ds = tf.data.Dataset.range(first_epoch, 1 << 62).flat_map(epoch).skip(offset)
  ds = tf.data.Dataset.zip(tf.data.Dataset.range(start, 1 << 62), ds)
  ds = _map(ds.map(_with_rng(seed, shard)), preprocess, num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True)
  return ds.batch(batch_size, drop_remainder=True)


def eval_batches(source: Source, split: str, pp: str, batch_size: int, *, process_index: int = 0,
                 process_count: int = 1, cache: bool | None = None,
                 text: TextSpec | None = None) -> tf.data.Dataset | TokenizedBatches:
  """A re-iterable dataset of full-size batches, `_mask` marking real examples. Every example of the
  split is read by exactly one process, and every process yields the same number of batches (the
  collective eval step needs that), padding with masked-out batches. `cache` keeps the raw split
  in memory for repeated evaluation (None: if it has at most 200,000 examples); a one-pass
  evaluation sets False, so memory does not grow. With `text`, also `tokens` of each first
  caption; `labels` only if there are classes."""
  _check_labels(source, text)
  preprocess = _finish(source, pp, text)
  raw = source.read(split, process_index, process_count, drop_remainder=False)
  total = source.num_examples(split)
  if cache or (cache is None and total <= _CACHE_MAX_EXAMPLES):
    raw = raw.cache()
  ds = tf.data.Dataset.zip(tf.data.Dataset.range(1 << 62), raw).map(_with_rng(0))
  ds = _map(ds, preprocess, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.map(lambda ex: {**ex, "_mask": tf.constant(True)})
  ds = ds.padded_batch(batch_size).map(lambda b: _pad_batch(b, batch_size))
  num_batches = math.ceil(math.ceil(total / process_count) / batch_size)
  empty = ds.take(1).map(lambda b: {k: tf.zeros_like(v) for k, v in b.items()}).repeat()
  ds = ds.concatenate(empty).take(num_batches).prefetch(2)
  return TokenizedBatches(ds, text) if text else ds


def _pad_batch(batch, batch_size):
  """Pads the last (short) batch with zeros so that every batch has the same shape."""
  n = tf.shape(batch["_mask"])[0]
  return {k: tf.concat([v, tf.zeros(tf.concat([[batch_size - n], tf.shape(v)[1:]], 0), v.dtype)], 0)
          for k, v in batch.items()}


def image_shape(source: Source, split: str, pp: str) -> tuple[int, ...]:
  """Shape of one preprocessed image: the pipeline's static shape where its ops fix every
  dimension (a resize, a crop), else found by running it on one example."""
  preprocess = _finish(source, pp)
  ds = tf.data.Dataset.zip(tf.data.Dataset.range(1), source.read(split).take(1))
  ds = _map(ds.map(_with_rng(0)), preprocess)
  static = ds.element_spec["image"].shape
  if static.is_fully_defined():
    return tuple(static.as_list())
  return tuple(next(iter(ds))["image"].shape)
