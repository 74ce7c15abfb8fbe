"""Reads the sharded checkpoints of google-research/vmoe (their released V-MoE and E³ weights)
with plain files, msgpack and numpy: their own loader needs TensorFlow and their package. The
layout, as their vmoe/checkpoints/{partitioned,serialization}.py write it:

* `<prefix>.index`: a msgpack map {"shard_count": N, "index": tree, "version": "20220622"}, without
  "version" in checkpoints written before mid 2022. Each leaf of the tree is msgpack extension
  type 8, packing (shaped array, [slice of each chunk], [data shard of each chunk]); a shaped array
  packs (shape, dtype name, weak type, named shape), a slice packs a packed (start, stop, step) per
  axis.
* `<prefix>.data-SSSSS-of-NNNNN` (shard number from 0 and count, 5 digits): a map
  {"__msgpack_array_chunk_a87ca2__": true, "<array number>": [[[piece, ...], slice], ...]}; the
  pieces (extension type 1: shape, dtype name, C-order bytes) are the chunk flattened and cut in
  parts of at most 1 GiB, the slice is extension type 6. Arrays are numbered in JAX's flatten order
  of the tree: dict keys sorted, lists in order, None skipped. (Unversioned checkpoints used the
  order of the saved pytree itself, the same for the nested dicts of the released weights.)"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

from runner.errors import CheckpointError

__all__ = ["is_vmoe_checkpoint", "read"]

_EXT_NDARRAY = 1
_EXT_SLICE_ND = 6
_EXT_INDEX_INFO = 8
_CHUNKS_MARKER = "__msgpack_array_chunk_a87ca2__"
_VERSIONS = (None, "20220622")  # None: written before the format had a version
_READ_SIZE = 1 << 20  # bytes read from a data shard at a time (the stream buffer grows to ~4x it)
_MSGPACK_ERRORS = (msgpack.UnpackException, ValueError, TypeError)  # what bad bytes raise

Box = tuple[tuple[int, int], ...]  # a chunk: (start, stop) along each axis of its array


class _Bad(Exception):
  """What is wrong with one file, worded to follow its name (`read` makes it a CheckpointError)."""


@dataclasses.dataclass
class _Leaf:
  """One array of the index: global shape and dtype, and the data shard of each chunk."""
  shape: tuple[int, ...]
  dtype: np.dtype
  raw_chunks: list  # [(slice as (start, stop, step) per axis, shard)], as stored
  name: str = ""
  chunks: dict = dataclasses.field(default_factory=dict)  # Box -> shard
  pending: set = dataclasses.field(default_factory=set)  # Boxes not read yet


def is_vmoe_checkpoint(path: str) -> bool:
  """True for a prefix with an `.index` file, or that file: a cheap test that reads nothing."""
  return os.path.isfile(_prefix(path) + ".index")


def read(path: str) -> dict[str, np.ndarray]:
  """Every array of the checkpoint at `path` (prefix or `.index` file) by its "/"-joined tree path,
  in its stored dtype and global shape; raises CheckpointError. The shards are streamed a chunk at a
  time into arrays allocated once: peak memory is the arrays plus ~3 copies of a chunk."""
  prefix = _prefix(path)
  index_path = prefix + ".index"
  if not os.path.isfile(index_path):
    raise CheckpointError(f"No V-MoE checkpoint at {path}: {index_path} does not exist.")
  try:
    count, leaves = _read_index(index_path)
  except (_Bad, OSError) as e:
    raise CheckpointError(f"V-MoE checkpoint index {index_path} {_what(e)}.") from None

  shard_names = {s: f"{prefix}.data-{s:05d}-of-{count:05d}"
                 for s in sorted({s for leaf in leaves for s in leaf.chunks.values()})}
  for name in shard_names.values():  # fail before reading gigabytes
    if not os.path.isfile(name):
      raise CheckpointError(
          f"V-MoE checkpoint {prefix} is missing its data shard {name}; its index expects {count} "
          f"shard(s) named {prefix}.data-NNNNN-of-{count:05d}.")
  arrays = [np.empty(leaf.shape, leaf.dtype) for leaf in leaves]
  for name in shard_names.values():
    try:
      _read_shard(name, leaves, arrays)
    except (_Bad, OSError) as e:
      raise CheckpointError(f"V-MoE checkpoint data shard {name} {_what(e)}.") from None
  for leaf in leaves:
    if leaf.pending:
      box = min(leaf.pending)
      raise CheckpointError(
          f"V-MoE checkpoint data shard {shard_names[leaf.chunks[box]]} lacks the chunk "
          f"{_show(box)} of {leaf.name} that the index {index_path} puts there.")
  return {leaf.name: array for leaf, array in zip(leaves, arrays)}


def shapes(path: str) -> dict[str, np.ndarray]:
  """Every array's shape and dtype from the index alone, as zero-stride views (no data read)."""
  index_path = _prefix(path) + ".index"
  try:
    _, leaves = _read_index(index_path)
  except (_Bad, OSError) as e:
    raise CheckpointError(f"V-MoE checkpoint index {index_path} {_what(e)}.") from None
  return {leaf.name: np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape) for leaf in leaves}


def _what(error: Exception) -> str:
  return str(error) if isinstance(error, _Bad) else f"could not be read ({error.strerror})"


def _prefix(path: str) -> str:
  return path if os.path.isfile(path + ".index") else path.removesuffix(".index")


def _dtype(name: Any) -> np.dtype:
  """numpy's dtype for a stored dtype name; bfloat16 and the float8s come from ml_dtypes."""
  if isinstance(name, str):
    try:
      dtype = np.dtype(name)
    except TypeError:
      dtype = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else None
    if dtype is not None and not dtype.hasobject:
      return dtype
  raise _Bad(f"names an unknown dtype {name!r}")


def _slice_axes(payload: bytes) -> tuple:
  axes = tuple(tuple(msgpack.unpackb(axis)) for axis in msgpack.unpackb(payload))
  if any(len(axis) != 3 for axis in axes):
    raise _Bad("holds a malformed chunk slice")
  return axes


def _index_ext(code: int, payload: bytes) -> Any:
  if code != _EXT_INDEX_INFO:
    return msgpack.ExtType(code, payload)
  aval, slices, shards = msgpack.unpackb(payload)
  shape, dtype = msgpack.unpackb(aval)[:2]
  if len(slices) != len(shards):
    raise _Bad(f"lists {len(slices)} chunk slices but {len(shards)} data shards for one array")
  return _Leaf(tuple(shape), _dtype(dtype), list(zip(map(_slice_axes, slices), shards)))


def _data_ext(code: int, payload: bytes) -> Any:
  if code == _EXT_NDARRAY:
    shape, dtype, buffer = msgpack.unpackb(payload)
    return np.frombuffer(buffer, _dtype(dtype)).reshape(shape)
  if code == _EXT_SLICE_ND:
    return _slice_axes(payload)
  return msgpack.ExtType(code, payload)


def _leaves(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
  """The leaves in JAX's flatten order, which numbers the arrays in the data shards."""
  if isinstance(tree, dict):
    for key in sorted(tree):
      yield from _leaves(tree[key], path + (str(key),))
  elif isinstance(tree, list):
    for i, subtree in enumerate(tree):
      yield from _leaves(subtree, path + (str(i),))
  elif tree is not None:
    yield "/".join(path), tree


def _read_index(index_path: str) -> tuple[int, list[_Leaf]]:
  with open(index_path, "rb") as f:
    content = f.read()
  try:
    content = msgpack.unpackb(content, ext_hook=_index_ext)
  except _MSGPACK_ERRORS:
    raise _Bad("is not a msgpack file in the V-MoE index format") from None
  if not isinstance(content, dict) or not {"shard_count", "index"} <= content.keys():
    raise _Bad("is not in the V-MoE index format (it lacks the shard_count and index entries)")
  if content.get("version") not in _VERSIONS:
    raise _Bad(f"has format version {content['version']!r}; this reader knows {_VERSIONS[1]} "
               "and the unversioned format")
  count = content["shard_count"]
  if type(count) is not int or count < 1:
    raise _Bad(f"has a shard_count of {count!r}, not a positive integer")
  leaves, names = [], set()
  for name, leaf in _leaves(content["index"]):
    if not isinstance(leaf, _Leaf):
      raise _Bad(f"has an entry {name!r} that is not an array description")
    if name in names:
      raise _Bad(f"has two arrays named {name!r}")
    names.add(name)
    leaf.name = name
    _check_chunks(leaf, count)
    leaves.append(leaf)
  return count, leaves


def _check_chunks(leaf: _Leaf, count: int) -> None:
  """Checks that the chunks tile the array exactly, so that np.empty leaves no value unset."""
  for axes, shard in leaf.raw_chunks:
    if type(shard) is not int or not 0 <= shard < count:
      raise _Bad(f"puts a chunk of {leaf.name} in data shard {shard!r}, not one of 0..{count - 1}")
    leaf.chunks[_box(axes, leaf)] = shard
  boxes = list(leaf.chunks)
  for i, a in enumerate(boxes):
    for b in boxes[i + 1:]:
      if all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b)):
        raise _Bad(f"has overlapping chunks {_show(a)} and {_show(b)} of {leaf.name}")
  covered, size = sum(map(_volume, boxes)), math.prod(leaf.shape)
  if covered != size:
    raise _Bad(f"has chunks covering {covered} of the {size} values of {leaf.name} "
               f"(shape {leaf.shape})")
  leaf.pending = set(boxes)


def _box(axes: Any, leaf: _Leaf) -> Box:
  """A stored slice as (start, stop) per axis, None ends filled in as the reference does."""
  if not isinstance(axes, tuple) or len(axes) != len(leaf.shape):
    raise _Bad(f"has a chunk slice of {leaf.name} that does not fit its shape {leaf.shape}")
  box = []
  for (start, stop, step), size in zip(axes, leaf.shape):
    start, stop = (0 if start is None else start), (size if stop is None else stop)
    if (step not in (None, 1) or type(start) is not int or type(stop) is not int
        or not 0 <= start <= stop <= size):
      raise _Bad(f"has a chunk slice {start}:{stop}:{step} of {leaf.name} that is not within its "
                 f"shape {leaf.shape}")
    box.append((start, stop))
  return tuple(box)


def _volume(box: Box) -> int:
  return math.prod(stop - start for start, stop in box)


def _show(box: Box) -> str:
  return "[" + ", ".join(f"{start}:{stop}" for start, stop in box) + "]"


def _read_shard(path: str, leaves: list[_Leaf], arrays: list[np.ndarray]) -> None:
  """Streams one data shard, copying each chunk into its array as soon as it is decoded."""
  size = os.path.getsize(path)
  limit = max(1, min(size, 2**31 - 1))  # a piece is at most 1 GiB
  with open(path, "rb") as f:
    stream = msgpack.Unpacker(f, ext_hook=_data_ext, max_buffer_size=limit,
                              read_size=min(limit, _READ_SIZE))
    try:
      for _ in range(stream.read_map_header()):
        key = stream.unpack()
        if key == _CHUNKS_MARKER:
          stream.skip()
          continue
        if not (isinstance(key, str) and key.isdigit() and int(key) < len(leaves)):
          raise _Bad(f"holds chunks of an array number {key!r} that the index does not list")
        for _ in range(stream.read_array_header()):
          if stream.read_array_header() != 2:
            raise _Bad("is corrupted (a chunk is not a pair of pieces and slice)")
          pieces = [stream.unpack() for _ in range(stream.read_array_header())]
          _fill(leaves[int(key)], arrays[int(key)], pieces, stream.unpack())
          del pieces  # before the next chunk is decoded
      end = stream.tell()
    except _MSGPACK_ERRORS:
      raise _Bad("is truncated or corrupted") from None
  if end != size:
    raise _Bad(f"is corrupted ({size - end} stray bytes after its content)")


def _fill(leaf: _Leaf, array: np.ndarray, pieces: list, axes: Any) -> None:
  if not all(isinstance(p, np.ndarray) for p in pieces):
    raise _Bad(f"holds a malformed chunk of {leaf.name}")
  box = _box(axes, leaf)
  if box not in leaf.pending:
    raise _Bad(f"holds a chunk {_show(box)} of {leaf.name} that the index does not list or that "
               "appeared before")
  found, wanted = sum(p.size for p in pieces), _volume(box)
  if found != wanted:
    raise _Bad(f"holds a chunk {_show(box)} of {leaf.name} with {found} values where its slice "
               f"has {wanted}")
  if wrong := [p.dtype for p in pieces if p.dtype != leaf.dtype]:
    raise _Bad(f"holds a chunk {_show(box)} of {leaf.name} in {wrong[0]}, where the index says "
               f"{leaf.dtype}")
  if wanted:
    flat = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    array[tuple(slice(start, stop) for start, stop in box)] = flat.reshape(
        tuple(stop - start for start, stop in box))
  leaf.pending.discard(box)
