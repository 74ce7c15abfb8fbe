"""tf.data pipelines (runner/data/pipeline.py) over uci_digits' validation split (179 examples).

The training stream must be a pure function of (seed, position): resuming at any position,
augmentations included, continues exactly the uninterrupted stream.
"""
from __future__ import annotations

import collections
import itertools
import sys

import numpy as np
import pytest
import tensorflow as tf

from runner import data
from runner.config.preprocessing import DEVICE_VALUE_RANGE
from runner.data import pipeline
from runner.models import inputs

SPLIT, N = "validation", 179
PLAIN = "decode(1)"
AUGMENT = "decode(3)|pad(2)|random_crop(8)|flip_lr|value_range(-1, 1)"


@pytest.fixture(scope="module")
def uci(tfds_dir):
  return data.open_source("uci_digits", data_dir=str(tfds_dir))


@pytest.fixture(scope="module")
def split_keys(uci):
  """Multiset of (image bytes, label) of the split, as the PLAIN spec yields them."""
  ds = data.eval_batches(uci, SPLIT, PLAIN, N)
  batch = next(ds.as_numpy_iterator())
  return collections.Counter(_keys(batch))


def _keys(batch) -> list[tuple[bytes, int]]:
  return [(im.tobytes(), int(y.argmax())) for im, y in zip(batch["image"], batch["labels"])]


def take(stream, n):
  return list(itertools.islice(stream, n))


def assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert set(x) == set(y) <= {"image", "labels", DEVICE_VALUE_RANGE}
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["labels"], y["labels"])


def test_batch_shapes_and_dtypes(uci):
  """The spec ends in value_range: its images stay uint8 pixels, which the step maps to [-1, 1]."""
  batch = next(data.train_batches(uci, SPLIT, AUGMENT, 16, seed=0))
  assert batch["image"].shape == (16, 8, 8, 3) and batch["image"].dtype == np.uint8
  assert batch["labels"].shape == (16, 10) and batch["labels"].dtype == np.float32
  np.testing.assert_array_equal(batch["labels"].sum(axis=1), 1.0)
  images = np.asarray(inputs.images(batch))
  assert images.dtype == np.float32 and images.min() >= -1 and images.max() <= 1


def test_same_seed_same_stream_and_other_seed_differs(uci):
  a = take(data.train_batches(uci, SPLIT, AUGMENT, 16, seed=3), 4)
  b = take(data.train_batches(uci, SPLIT, AUGMENT, 16, seed=3), 4)
  assert_same_batches(a, b)
  c = take(data.train_batches(uci, SPLIT, AUGMENT, 16, seed=4), 4)
  for x, y in zip(a, c):
    assert not np.array_equal(x["image"], y["image"])
    assert not np.array_equal(x["labels"], y["labels"])


@pytest.fixture(scope="module")
def reference(uci):
  """The uninterrupted augmented stream: 26 batches of 16 = 416 examples, over 2.3 epochs."""
  return take(data.train_batches(uci, SPLIT, AUGMENT, 16, seed=7), 26)


# k=11 covers positions 176..191, across the first epoch boundary (179); k=22 the second (358)
@pytest.mark.parametrize("k", [1, 5, 11, 12, 22])
def test_resume_at_batch_boundary_continues_the_stream(uci, reference, k):
  resumed = take(data.train_batches(uci, SPLIT, AUGMENT, 16, seed=7, start=16 * k), 3)
  assert_same_batches(resumed, reference[k:k + 3])


@pytest.mark.parametrize("start", [5, 170, 179, 181])
def test_resume_at_any_position_continues_the_stream(uci, reference, start):
  """Positions count examples: a resumed stream is the reference shifted by `start` examples."""
  flat_images = np.concatenate([b["image"] for b in reference])
  flat_labels = np.concatenate([b["labels"] for b in reference])
  resumed = take(data.train_batches(uci, SPLIT, AUGMENT, 16, seed=7, start=start), 2)
  images = np.concatenate([b["image"] for b in resumed])
  labels = np.concatenate([b["labels"] for b in resumed])
  np.testing.assert_array_equal(images, flat_images[start:start + 32])
  np.testing.assert_array_equal(labels, flat_labels[start:start + 32])


def test_augmentation_depends_on_position_not_only_on_the_image(uci):
  """The same example in two epochs gets different random crops/flips (seeded by position)."""
  spec = "decode(3)|pad(2)|random_crop(8)|flip_lr"
  aug = data.train_batches(uci, SPLIT, spec, N, seed=2)
  plain = data.train_batches(uci, SPLIT, PLAIN, N, seed=2)  # same order: names each position
  where: dict[bytes, list[np.ndarray]] = collections.defaultdict(list)
  for _ in range(2):
    for key, image in zip(_keys(next(plain)), next(aug)["image"]):
      where[key].append(image)
  assert len(where) == N and all(len(v) == 2 for v in where.values())
  differ = sum(not np.array_equal(a, b) for a, b in where.values())
  assert differ > N // 2, differ


@pytest.mark.parametrize("shuffle_buffer", [N, 10])
def test_each_epoch_holds_every_example_once(uci, split_keys, shuffle_buffer):
  stream = data.train_batches(uci, SPLIT, PLAIN, 16, seed=11, shuffle_buffer=shuffle_buffer)
  batches = take(stream, 23)  # 368 examples: epochs 0 and 1 and 10 of epoch 2
  keys = [k for b in batches for k in _keys(b)]
  epochs = [keys[:N], keys[N:2 * N]]
  for epoch in epochs:
    assert collections.Counter(epoch) == split_keys
  assert epochs[0] != epochs[1], "each epoch has its own order"
  assert epochs[0] != list(split_keys), "the order is shuffled"


def test_stream_shuffle_order_differs_between_epochs_and_seeds(uci):
  orders = []
  for seed in (0, 1):
    stream = data.train_batches(uci, SPLIT, PLAIN, N, seed=seed)
    orders.append([tuple(_keys(next(stream))) for _ in range(2)])
  assert orders[0][0] != orders[0][1] and orders[0][0] != orders[1][0]


def test_process_shards_are_disjoint(uci, split_keys):
  shards = []
  for index in range(3):
    stream = data.train_batches(uci, SPLIT, PLAIN, 59, seed=0, process_index=index,
                                process_count=3)
    first, second = next(stream), next(stream)  # one epoch of 59 each, then the next
    assert collections.Counter(_keys(first)) == collections.Counter(_keys(second))
    shards.append(set(_keys(first)))
  assert [len(s) for s in shards] == [59, 59, 59]
  assert not (shards[0] & shards[1] or shards[0] & shards[2] or shards[1] & shards[2])
  assert set().union(*shards) <= set(split_keys)


def test_process_shard_resumes_too(uci):
  kw = dict(seed=9, process_index=1, process_count=2)
  reference = take(data.train_batches(uci, SPLIT, AUGMENT, 8, **kw), 13)  # 104 > 89 per process
  resumed = take(data.train_batches(uci, SPLIT, AUGMENT, 8, start=80, **kw), 3)
  assert_same_batches(resumed, reference[10:13])


def test_train_split_smaller_than_a_batch(uci):
  with pytest.raises(ValueError, match="fewer than one batch"):
    data.train_batches(uci, "validation[:10]", PLAIN, 16, seed=0)


def test_sub_split_stream_uses_only_the_slice(uci, split_keys):
  ds = data.eval_batches(uci, "validation[:40]", PLAIN, 40)
  want = collections.Counter(_keys(next(ds.as_numpy_iterator())))
  batch = next(data.train_batches(uci, "validation[:40]", PLAIN, 40, seed=0))
  assert collections.Counter(_keys(batch)) == want
  assert sum(want.values()) == 40 and not (set(want) - set(split_keys))


# --- eval ------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size,n_batches", [(32, 6), (179, 1), (1, 179), (200, 1)])
def test_eval_batches_are_padded_with_a_mask(uci, split_keys, batch_size, n_batches):
  batches = list(data.eval_batches(uci, SPLIT, PLAIN, batch_size).as_numpy_iterator())
  assert len(batches) == n_batches
  for b in batches:
    assert set(b) == {"image", "labels", "_mask"}
    assert b["image"].shape == (batch_size, 8, 8, 1) and b["image"].dtype == np.float32
    assert b["labels"].shape == (batch_size, 10) and b["_mask"].dtype == bool
  mask = np.concatenate([b["_mask"] for b in batches])
  assert mask.sum() == N
  assert mask[:N].all() and not mask[N:].any()  # real rows first, padding only at the end
  images = np.concatenate([b["image"] for b in batches])
  labels = np.concatenate([b["labels"] for b in batches])
  assert not images[N:].any() and not labels[N:].any()
  real = collections.Counter((im.tobytes(), int(y.argmax())) for im, y in
                             zip(images[:N], labels[:N]))
  assert real == split_keys


def test_eval_batches_follow_the_split_order_and_reiterate(uci):
  ds = data.eval_batches(uci, SPLIT, AUGMENT, 50)
  first = list(ds.as_numpy_iterator())
  second = list(ds.as_numpy_iterator())
  for a, b in zip(first, second):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  labels = np.concatenate([b["labels"] for b in first])[:N].argmax(1)
  stored = [int(ex["label"]) for ex in uci.read(SPLIT).as_numpy_iterator()]
  np.testing.assert_array_equal(labels, stored)


def test_eval_shards(uci):
  for index in range(2):
    batches = list(data.eval_batches(uci, SPLIT, PLAIN, 32, process_index=index,
                                     process_count=2).as_numpy_iterator())
    assert len(batches) == 3 and all(b["image"].shape[0] == 32 for b in batches)
    assert sum(int(b["_mask"].sum()) for b in batches) >= N // 2


@pytest.mark.parametrize("count", [2, 3])
def test_eval_shards_cover_the_whole_split(uci, count):
  real = 0
  for index in range(count):
    for b in data.eval_batches(uci, SPLIT, PLAIN, 32, process_index=index,
                               process_count=count).as_numpy_iterator():
      real += int(b["_mask"].sum())
  assert real == N


@pytest.mark.parametrize("spec,shape", [(PLAIN, (8, 8, 1)), ("decode(3)", (8, 8, 3)),
                                        ("decode(3)|resize(16)", (16, 16, 3)),
                                        (AUGMENT, (8, 8, 3)),
                                        ("decode(1)|inception_crop(5)", (5, 5, 1))])
def test_image_shape(uci, spec, shape):
  assert data.image_shape(uci, SPLIT, spec) == shape
  if spec == PLAIN:
    assert data.image_shape(uci, "train[-1:]", spec) == shape


def test_bad_spec_fails_before_reading(uci):
  with pytest.raises(data.PreprocessError):
    data.train_batches(uci, SPLIT, "decode(3)|sharpen", 8, seed=0)
  with pytest.raises(data.PreprocessError):
    data.eval_batches(uci, SPLIT, "decode(3", 8)
  with pytest.raises(data.DataError):
    data.eval_batches(uci, "nope", PLAIN, 8)


def test_error_raised_while_tracing_keeps_its_type(uci):
  # tf.data traces the preprocessing with autograph, which would turn the error into a
  # StagingError (no UserError: the CLI would print a traceback) unless it can rebuild its type.
  with pytest.raises(data.PreprocessError, match="leaves no decoded image"):
    data.eval_batches(uci, SPLIT, "keep('label')", 8)
  with pytest.raises(data.PreprocessError, match="removed the label"):
    data.train_batches(uci, SPLIT, "decode(3)|keep('image')", 8, seed=0)


@pytest.mark.parametrize("cache, limit, cached", [(None, 200_000, True), (None, 100, False),
                                                  (True, 100, True), (False, 200_000, False)])
def test_data_cache_keeps_the_records_in_memory(uci, monkeypatch, cache, limit, cached):
  """data.cache: null caches a shard of at most the limit's examples (179 here), true any,
  false none; the stream is the same either way."""
  calls = []  # the pipeline's own (a source may cache what it reads too)
  original = tf.data.Dataset.cache

  def spy(self, *args, **kwargs):
    calls.append(sys._getframe(1).f_code.co_filename == pipeline.__file__)
    return original(self, *args, **kwargs)
  monkeypatch.setattr(tf.data.Dataset, "cache", spy)
  monkeypatch.setattr(pipeline, "_CACHE_MAX_EXAMPLES", limit)
  stream = take(data.train_batches(uci, SPLIT, AUGMENT, 16, seed=7, cache=cache), 2)
  eval_ds = data.eval_batches(uci, SPLIT, PLAIN, 64, cache=cache)
  assert sum(calls) == (2 if cached else 0)
  monkeypatch.undo()
  assert_same_batches(stream, take(data.train_batches(uci, SPLIT, AUGMENT, 16, seed=7), 2))
  assert len(list(eval_ds.as_numpy_iterator())) == 3
