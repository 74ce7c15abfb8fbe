"""Writes tiny checkpoints in the sharded format of google-research/vmoe, so that tests can make
them without TensorFlow or the vmoe package. Written from the format description, apart from the
reader in runner/checkpoints/vmoe_format.py, so that the two check each other.

Format: `<prefix>.index` is a msgpack map {"shard_count": N, "index": nested tree, "version"}, each
tree leaf msgpack extension 8 packing (shaped array, [chunk slices], [chunk shards]); each
`<prefix>.data-SSSSS-of-NNNNN` is a map {"__msgpack_array_chunk_a87ca2__": True,
"<array number>": [[[flat piece (extension 1), ...], slice (extension 6)], ...]}, arrays numbered
in sorted-key order of the tree.
"""
from __future__ import annotations

import itertools
import os

import msgpack
import numpy as np


def _pack(obj) -> bytes:
  return msgpack.packb(obj, use_bin_type=True)


def _slice_nd(bounds) -> bytes:
  return _pack([_pack([start, stop, None]) for start, stop in bounds])


def _chunk_bounds(shape, chunks_per_array):
  """Cuts axis 0 in up to `chunks_per_array` near-equal parts; one chunk for 0-d arrays."""
  if not shape:
    return [()]
  parts = max(1, min(chunks_per_array, shape[0]))
  cuts = np.linspace(0, shape[0], parts + 1).round().astype(int).tolist()
  rest = tuple((0, n) for n in shape[1:])
  return [((a, b),) + rest for a, b in itertools.pairwise(cuts)]


def write(prefix: str, flat_params: dict[str, np.ndarray], num_shards: int = 2,
          chunks_per_array: int = 1, *, piece_items: int | None = None,
          version: str | None = "20220622") -> None:
  """Writes `flat_params` ("a/b/c" keys) as a checkpoint at `prefix`: arrays cut along axis 0 into
  `chunks_per_array` chunks, chunks dealt to the shards in turn, each chunk stored as flat pieces of
  at most `piece_items` values (the reference cuts at 1 GiB)."""
  tree: dict = {}
  for name, value in flat_params.items():
    *parents, leaf = name.split("/")
    node = tree
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = np.asarray(value)

  def in_order(node, path=()):
    for key in sorted(node):
      if isinstance(node[key], dict):
        yield from in_order(node[key], path + (key,))
      else:
        yield path + (key,), node[key]

  shards = [{"__msgpack_array_chunk_a87ca2__": True} for _ in range(num_shards)]
  index: dict = {}
  turn = 0
  for number, (path, array) in enumerate(in_order(tree)):
    slices, owners = [], []
    for bounds in _chunk_bounds(array.shape, chunks_per_array):
      flat = np.ascontiguousarray(array[tuple(slice(a, b) for a, b in bounds)]).reshape(-1)
      step = piece_items or max(flat.size, 1)
      pieces = [msgpack.ExtType(1, _pack([[piece.size], piece.dtype.name, piece.tobytes()]))
                for piece in (flat[i:i + step] for i in range(0, max(flat.size, 1), step))]
      shard = turn % num_shards
      turn += 1
      shards[shard].setdefault(str(number), []).append(
          [pieces, msgpack.ExtType(6, _slice_nd(bounds))])
      slices.append(_slice_nd(bounds))
      owners.append(shard)
    aval = _pack([list(array.shape), array.dtype.name, False, {}])
    node = index
    for part in path[:-1]:
      node = node.setdefault(part, {})
    node[path[-1]] = msgpack.ExtType(8, _pack([aval, slices, owners]))

  content = {"shard_count": num_shards, "index": index}
  if version is not None:
    content["version"] = version
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
  with open(prefix + ".index", "wb") as f:
    f.write(_pack(content))
  for i, shard in enumerate(shards):
    with open(f"{prefix}.data-{i:05d}-of-{num_shards:05d}", "wb") as f:
      f.write(_pack(shard))
