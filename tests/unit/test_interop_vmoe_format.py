"""The reader of google-research/vmoe checkpoints: round trips through the test writer, the exact
bytes the reference code writes, and one clear CheckpointError per kind of broken file."""
from __future__ import annotations

import dataclasses
import os
import tracemalloc

import ml_dtypes
import msgpack
import numpy as np
import pytest
from formats import vmoe_writer

from runner.checkpoints import vmoe_format
from runner.checkpoints.checkpoint import CheckpointError
from runner.errors import UserError

BF16 = ml_dtypes.bfloat16


def _params() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
      "Encoder/encoderblock_1/Moe/Mlp/Dense_0/kernel":
          rng.normal(size=(4, 3, 5)).astype(np.float32),
      "Encoder/encoderblock_1/Moe/Mlp/Dense_0/bias": rng.normal(size=(4, 5)).astype(BF16),
      "Encoder/encoder_norm/scale": rng.normal(size=(7,)).astype(np.float32),
      "cls": rng.normal(size=(1, 1, 3)).astype(BF16),
      "embedding/kernel": rng.integers(-9, 9, size=(2, 2, 3, 6)).astype(np.int32),
      "head/bias": np.float32(0.25).reshape(()),
      "head/step": np.array(7, np.int32),
  }


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    assert got[name].dtype == value.dtype, name
    assert got[name].shape == value.shape, name
    # Bit patterns: exact for every dtype, bfloat16 included.
    assert got[name].tobytes() == np.ascontiguousarray(value).tobytes(), name


@pytest.mark.parametrize("num_shards, chunks_per_array, piece_items", [
    (1, 1, None), (2, 1, None), (3, 2, None), (2, 4, 5), (5, 3, 2)])
def test_round_trip(tmp_path, num_shards, chunks_per_array, piece_items):
  prefix = str(tmp_path / "ckpt" / "vmoe_b16")
  params = _params()
  vmoe_writer.write(prefix, params, num_shards=num_shards, chunks_per_array=chunks_per_array,
                    piece_items=piece_items)
  assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(["vmoe_b16.index"] + [
      f"vmoe_b16.data-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)])
  _assert_same(vmoe_format.read(prefix), params)
  _assert_same(vmoe_format.read(prefix + ".index"), params)


def test_shapes_come_from_the_index_alone(tmp_path):
  prefix = str(tmp_path / "ckpt")
  params = _params()
  vmoe_writer.write(prefix, params, num_shards=2)
  for shard in range(2):  # no data is read
    os.remove(f"{prefix}.data-{shard:05d}-of-00002")
  got = vmoe_format.shapes(prefix)
  assert {n: (a.shape, a.dtype) for n, a in got.items()} == {
      n: (a.shape, a.dtype) for n, a in params.items()}


def test_writer_spreads_one_array_over_several_shards(tmp_path):
  """Guards the round trip above: chunk assembly across shards is really exercised."""
  prefix = str(tmp_path / "ckpt")
  vmoe_writer.write(prefix, {"a": np.zeros((4, 2), np.float32)}, num_shards=2, chunks_per_array=2)
  for shard in range(2):
    with open(f"{prefix}.data-{shard:05d}-of-00002", "rb") as f:
      assert len(msgpack.unpackb(f.read())["0"]) == 1


def test_unversioned_checkpoint_and_other_top_level_entries(tmp_path):
  prefix = str(tmp_path / "ckpt")
  params = {"params/head/kernel": np.ones((3, 2), np.float32),
            "opt_state/mu/head/kernel": np.full((3, 2), 2, np.float32),
            "step": np.array(10, np.int32)}
  vmoe_writer.write(prefix, params, num_shards=2, chunks_per_array=2, version=None)
  _assert_same(vmoe_format.read(prefix), params)


def test_is_vmoe_checkpoint(tmp_path):
  prefix = str(tmp_path / "ckpt")
  vmoe_writer.write(prefix, {"a": np.zeros(3, np.float32)})
  assert vmoe_format.is_vmoe_checkpoint(prefix)
  assert vmoe_format.is_vmoe_checkpoint(prefix + ".index")
  assert not vmoe_format.is_vmoe_checkpoint(prefix + ".data-00000-of-00002")
  assert not vmoe_format.is_vmoe_checkpoint(str(tmp_path))
  assert not vmoe_format.is_vmoe_checkpoint(str(tmp_path / "other"))
  assert not vmoe_format.is_vmoe_checkpoint(str(tmp_path / "other.index"))


def test_memory_is_the_arrays_plus_about_one_chunk(tmp_path):
  """A B/16 V-MoE is ~4 GB: the reader must not hold a whole shard (or the checkpoint) twice."""
  prefix = str(tmp_path / "ckpt")
  array = np.arange(64 * 2**17, dtype=np.float32).reshape(64, 2**17)  # 32 MiB, one shard
  vmoe_writer.write(prefix, {"a": array}, num_shards=1, chunks_per_array=64)
  tracemalloc.start()
  try:
    got = vmoe_format.read(prefix)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert np.array_equal(got["a"], array)
  assert peak < 1.4 * array.nbytes, f"peak {peak / 2**20:.0f} MiB for a 32 MiB checkpoint"


# --- The exact bytes of the reference (vmoe/checkpoints/serialization.py and partitioned.py),
# built here by hand, so that a writer and reader that agree only with each other fail.

class _Slices(tuple):
  """Stands in for the reference's SliceNd: (start, stop, step) per axis."""


@dataclasses.dataclass
class _IndexInfo:
  """Stands in for the reference's IndexInfo (its ShapedArray taken from the array itself)."""
  array: np.ndarray
  weak_type: bool
  slices: list
  shards: list


def _ref_slice_nd(slices) -> bytes:
  return msgpack.packb(tuple(msgpack.packb(tuple(s), use_bin_type=True) for s in slices),
                       use_bin_type=True)


def _ref_ndarray(x: np.ndarray) -> bytes:
  return msgpack.packb((x.shape, x.dtype.name, x.tobytes("C")), use_bin_type=True)


def _ref_default(x):
  """The reference's msgpack `default`: ext 1 ndarray, 6 SliceNd, 8 IndexInfo."""
  if isinstance(x, np.ndarray):
    return msgpack.ExtType(1, _ref_ndarray(x))
  if isinstance(x, _Slices):
    return msgpack.ExtType(6, _ref_slice_nd(x))
  if isinstance(x, _IndexInfo):  # named shape: {} (always empty in the released checkpoints)
    aval = msgpack.packb((x.array.shape, x.array.dtype.name, x.weak_type, {}), use_bin_type=True)
    return msgpack.ExtType(8, msgpack.packb(
        (aval, tuple(map(_ref_slice_nd, x.slices)), tuple(x.shards)), use_bin_type=True))
  return x


def test_ndarray_payload_is_the_one_flax_writes():
  """The reference encodes arrays with flax.serialization._ndarray_to_bytes."""
  flax_serialization = pytest.importorskip("flax.serialization")
  to_bytes = getattr(flax_serialization, "_ndarray_to_bytes", None)
  if to_bytes is None:
    pytest.skip("this flax has no _ndarray_to_bytes")
  for x in (np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, BF16), np.arange(3)[:2]):
    assert _ref_ndarray(x) == to_bytes(x)


@pytest.mark.parametrize("version", ["20220622", None])
def test_reads_the_bytes_the_reference_writes(tmp_path, version):
  jax = pytest.importorskip("jax")
  kernel = np.arange(4 * 3 * 6, dtype=np.float32).reshape(4, 3, 6)  # experts on axis 0
  cls = np.array([[[1.5, -2.0, 3.25]]], BF16)
  bias = np.arange(6, dtype=np.int32) - 3
  scale = np.float32(-0.5).reshape(())
  # Inserted out of order: the reference numbers arrays in JAX's flatten order.
  tree = {"head": {"bias": bias}, "cls": cls, "embedding": {"scale": scale},
          "Encoder": {"encoderblock_1": {"Moe": {"Mlp": {"Dense_0": {"kernel": kernel}}}}}}
  leaves = jax.tree_util.tree_leaves(tree)
  # kernel: a 2x2 grid of chunks over axes 0 and 2, sorted as the reference sorts its SliceNds.
  grid = [((a, a + 2, None), (0, 3, None), (b, b + 3, None)) for a in (0, 2) for b in (0, 3)]
  chunks = {
      id(kernel): (grid, [0, 1, 1, 0]),
      id(cls): ([((0, 1, None), (0, 1, None), (0, 3, None))], [1]),
      id(bias): ([((0, 6, None),)], [0]),
      id(scale): ([()], [1]),
  }

  def describe(node):  # keeps the unsorted key order, which the reference's reader does not use
    if isinstance(node, dict):
      return {key: describe(value) for key, value in node.items()}
    return _IndexInfo(node, version is None, *chunks[id(node)])

  index_tree = describe(tree)
  index = {"shard_count": 3, "index": index_tree}
  if version:
    index["version"] = version
  data = [{"__msgpack_array_chunk_a87ca2__": True} for _ in range(3)]  # shard 2 holds nothing
  for number, x in enumerate(leaves):
    for slices, shard in zip(*chunks[id(x)]):
      flat = x[tuple(slice(s[0], s[1]) for s in slices)].flatten()
      pieces = [flat[i:i + 4] for i in range(0, flat.size, 4)]  # as the 1 GiB cut, smaller
      data[shard].setdefault(str(number), []).append([pieces, _Slices(slices)])
  prefix = str(tmp_path / "vmoe_ref")
  with open(prefix + ".index", "wb") as f:
    f.write(msgpack.packb(index, default=_ref_default, strict_types=True))
  for shard, content in enumerate(data):
    with open(f"{prefix}.data-{shard:05d}-of-00003", "wb") as f:
      f.write(msgpack.packb(content, default=_ref_default, strict_types=True))

  _assert_same(vmoe_format.read(prefix), {
      "Encoder/encoderblock_1/Moe/Mlp/Dense_0/kernel": kernel, "cls": cls,
      "embedding/scale": scale, "head/bias": bias})


# --- Broken checkpoints: one CheckpointError, one sentence, naming the file at fault.

def _small(tmp_path) -> str:
  """a: 4x3 float32 in chunks [0:2] (shard 0) and [2:4] (shard 1); b: 5 int32 likewise."""
  prefix = str(tmp_path / "ckpt")
  vmoe_writer.write(prefix, {"a": np.arange(12, dtype=np.float32).reshape(4, 3),
                             "b": np.arange(5, dtype=np.int32)},
                    num_shards=2, chunks_per_array=2)
  return prefix


def _shard(prefix: str, i: int) -> str:
  return f"{prefix}.data-{i:05d}-of-00002"


def _edit(path: str, change) -> None:
  with open(path, "rb") as f:
    content = msgpack.unpackb(f.read())
  change(content)
  with open(path, "wb") as f:
    f.write(msgpack.packb(content, use_bin_type=True))


def _edit_index_entry(prefix: str, name: str, change) -> None:
  def edit(content):
    aval, slices, shards = msgpack.unpackb(content["index"][name].data)
    slices, shards = change(slices, shards)
    content["index"][name] = msgpack.ExtType(8, msgpack.packb([aval, slices, shards]))
  _edit(prefix + ".index", edit)


def _error(path: str, culprit: str) -> str:
  with pytest.raises(CheckpointError) as caught:
    vmoe_format.read(path)
  message = str(caught.value)
  assert isinstance(caught.value, UserError)
  assert culprit in message
  assert "\n" not in message and "Traceback" not in message and message.endswith(".")
  return message


def test_missing_index(tmp_path):
  message = _error(str(tmp_path / "nothing"), str(tmp_path / "nothing.index"))
  assert "does not exist" in message


@pytest.mark.parametrize("content, says", [
    (b"these are not msgpack bytes \xc1\xc1", "not a msgpack file"),
    (msgpack.packb({"params": {"a": [1, 2]}}), "lacks the shard_count and index"),
    (msgpack.packb([1, 2, 3]), "lacks the shard_count and index"),
    (msgpack.packb({"shard_count": 1, "index": {"a": 1.5}}), "not an array description"),
    (msgpack.packb({"shard_count": 0, "index": {}}), "not a positive integer"),
    (msgpack.packb({"shard_count": 1, "index": {}, "version": "20990101"}), "format version"),
])
def test_index_that_is_not_this_format(tmp_path, content, says):
  prefix = str(tmp_path / "ckpt")
  with open(prefix + ".index", "wb") as f:
    f.write(content)
  assert says in _error(prefix + ".index", prefix + ".index")


def test_missing_data_shard(tmp_path):
  prefix = _small(tmp_path)
  os.remove(_shard(prefix, 1))
  message = _error(prefix, _shard(prefix, 1))
  assert "missing" in message and "expects 2 shard" in message


@pytest.mark.parametrize("cut", [1, 0.5, 0.9])
def test_truncated_data_shard(tmp_path, cut):
  prefix = _small(tmp_path)
  with open(_shard(prefix, 0), "rb") as f:
    content = f.read()
  with open(_shard(prefix, 0), "wb") as f:
    f.write(content[:int(len(content) * cut) - 1])
  assert "truncated" in _error(prefix, _shard(prefix, 0))


@pytest.mark.parametrize("corrupt, says", [
    (lambda content: b"\xc1" * len(content), "corrupted"),
    (lambda content: content + b"\x00\x01", "stray bytes"),
    (lambda content: msgpack.packb(["not", "a", "map"]), "corrupted"),
])
def test_corrupted_data_shard(tmp_path, corrupt, says):
  prefix = _small(tmp_path)
  with open(_shard(prefix, 1), "rb") as f:
    content = f.read()
  with open(_shard(prefix, 1), "wb") as f:
    f.write(corrupt(content))
  assert says in _error(prefix, _shard(prefix, 1))


def test_chunk_whose_size_does_not_match_its_slice(tmp_path):
  prefix = _small(tmp_path)

  def drop_one_value(content):
    content["0"][0][0] = [msgpack.ExtType(1, msgpack.packb(
        [[5], "float32", np.arange(5, dtype=np.float32).tobytes()]))]
  _edit(_shard(prefix, 0), drop_one_value)
  message = _error(prefix, _shard(prefix, 0))
  assert "[0:2, 0:3] of a with 5 values" in message


def test_chunk_of_another_dtype(tmp_path):
  prefix = _small(tmp_path)

  def as_int32(content):
    content["0"][0][0] = [msgpack.ExtType(1, msgpack.packb(
        [[6], "int32", np.arange(6, dtype=np.int32).tobytes()]))]
  _edit(_shard(prefix, 0), as_int32)
  assert "int32" in _error(prefix, _shard(prefix, 0))


def test_array_not_covered_by_its_chunks(tmp_path):
  prefix = _small(tmp_path)
  _edit_index_entry(prefix, "a", lambda slices, shards: (slices[:1], shards[:1]))
  message = _error(prefix, prefix + ".index")
  assert "covering 6 of the 12 values of a" in message


def test_array_with_overlapping_chunks(tmp_path):
  prefix = _small(tmp_path)
  overlap = msgpack.packb([msgpack.packb([1, 3, None]), msgpack.packb([0, 3, None])])
  _edit_index_entry(prefix, "a", lambda slices, shards: ([slices[0], overlap], shards))
  assert "overlapping chunks" in _error(prefix, prefix + ".index")


def test_chunk_missing_from_its_data_shard(tmp_path):
  prefix = _small(tmp_path)
  _edit(_shard(prefix, 1), lambda content: content.pop("0"))
  message = _error(prefix, _shard(prefix, 1))
  assert "lacks the chunk [2:4, 0:3] of a" in message
