"""The grouped matmul of dropless routing: rows sorted by expert, each through its expert's kernel.

XLA lowers `jax.lax.ragged_dot` densely, every row with every expert's kernel (E times the FLOPs;
docs/routers.md), so by default `grouped_matmul` runs every block of B rows through its expert's
kernel in one batched matmul, as MegaBlocks does. On an NVIDIA GPU two grouped kernels can run
instead: vmoe's own in Pallas ("pallas", grouped_matmul_kernel.py) and cuDNN's, which XLA
substitutes for ragged_dot when a program is compiled with COMPILER_OPTIONS["cudnn"] ("cudnn").
"auto" takes a method on a backend only where a recorded `make bench-gpu` row shows it fastest.
Which methods need an NVIDIA GPU or bfloat16 is runner/accelerator.py's `grouped_matmul_problem`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from runner.models.moe.grouped_matmul_kernel import grouped_matmul_pallas

METHODS = ("auto", "blocks", "ragged_dot", "pallas", "cudnn")
# "auto"'s choice by backend (jax.default_backend()), each backed by a recorded bench-gpu row in
# which it was the fastest dropless method there; blocks elsewhere. None recorded yet: the one
# GPU run (H200, 2026-11-28, benchmarks/results/gpu.json) had blocks ahead of ragged_dot.
AUTO: dict[str, str] = {}
# What a program running the method must be compiled with (`jax.jit(..., compiler_options=)`):
# XLA's cuDNN ragged-dot fusion (forward and input gradient; jaxlib 0.10.2, cuDNN >= 9.22).
COMPILER_OPTIONS = {"cudnn": {"xla_gpu_experimental_use_ragged_dot_fusion": True}}


def resolve(method: str = "auto") -> str:
  """The method "auto" stands for on this backend; any other method as given."""
  if method not in METHODS:
    raise ValueError(f"unknown grouped matmul {method!r}; valid: {METHODS}")
  return AUTO.get(jax.default_backend(), "blocks") if method == "auto" else method


def compiler_options(method: str) -> dict:
  """The compiler options a program that runs `method` needs (none for most)."""
  return dict(COMPILER_OPTIONS.get(resolve(method), {}))


def block_rows(rows: int, experts: int) -> int:
  """B, a power of two near rows / (4 E): the padding (at most E*B rows) stays within a quarter of
  the rows, and the blocks large enough to be efficient matmuls (16 to 512 rows)."""
  target = max(1, rows // (4 * experts))
  return int(min(512, max(16, 1 << (target.bit_length() - 1))))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   method: str = "auto") -> jax.Array:
  """x: (M, D) rows sorted by group, group_sizes[e] of them group e's; w: (E, D, H) -> (M, H),
  row r times the kernel of its group: `jax.lax.ragged_dot(x, w, group_sizes)`."""
  method = resolve(method)
  if method in ("ragged_dot", "cudnn"):  # cudnn: the same op, fused by the compiler options
    return jax.lax.ragged_dot(x, w, group_sizes)
  if method == "pallas":
    return grouped_matmul_pallas(x, vary_like(w, x), group_sizes)
  return _by_blocks(x, w, group_sizes, block_rows(x.shape[0], w.shape[0]))


def _varying(x) -> frozenset:
  """The mesh axes over which x varies inside `shard_map` (none outside); JAX 0.10's
  `manual_axis_type`, or the `vma` of earlier versions."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """x, marked as varying over the mesh axes `like` varies over. A custom VJP inside `shard_map`
  must give each input a cotangent of the input's own type: a replicated weight meeting a
  device's rows gets a per-device gradient, so the weight is cast first (what autodiff of a
  gather does by itself), and the cast's transpose sums the gradients over the devices."""
  missing = tuple(sorted(_varying(like) - _varying(x)))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


def take_by_id(table: jax.Array, ids: jax.Array) -> jax.Array:
  """table: (E, ...), ids: (N,) -> (N, ...), entry n = table[ids[n]]: a bias per row, a kernel
  per block. Its gradient sums each id's entries as a one-hot product accumulated in float32 (a
  matmul of E x N by N x the entry's size), where autodiff of the gather would scatter-add N
  entries into E, colliding (atomics on a GPU, summed in the table's dtype)."""
  return _take_by_id(vary_like(table, ids), ids)


@jax.custom_vjp
def _take_by_id(table: jax.Array, ids: jax.Array) -> jax.Array:
  return table[ids]


def _take_by_id_fwd(table, ids):
  return table[ids], (ids, jnp.empty((table.shape[0], 0), table.dtype))  # E and dtype, no data


def _take_by_id_bwd(residuals, d_entries):
  ids, like = residuals
  d_flat = d_entries.reshape(d_entries.shape[0], -1)
  if jax.default_backend() == "cpu":  # XLA's CPU dot has no bfloat16 x bfloat16 -> float32
    d_flat = d_flat.astype(jnp.float32)
  onehot = jax.nn.one_hot(ids, like.shape[0], dtype=d_flat.dtype)
  d_table = jnp.einsum("ne,nf->ef", onehot, d_flat, preferred_element_type=jnp.float32)
  return d_table.reshape((like.shape[0],) + d_entries.shape[1:]).astype(like.dtype), None


_take_by_id.defvjp(_take_by_id_fwd, _take_by_id_bwd)


def _by_blocks(x: jax.Array, w: jax.Array, group_sizes: jax.Array, block: int) -> jax.Array:
  rows, dim = x.shape
  experts = w.shape[0]
  num_blocks = -(-rows // block) + experts  # enough for every expert's last, partial block
  group_sizes = group_sizes.astype(jnp.int32)
  padded = (group_sizes + block - 1) // block * block
  padded_end = jnp.cumsum(padded)
  end = jnp.cumsum(group_sizes)
  start, padded_start = end - group_sizes, padded_end - padded
  # The group of each row, and the expert of each block, by counting the groups that end at or
  # before it (comparisons, where a search or `jnp.repeat` is a loop or a scatter-add); rows past
  # the last group take the last, and so do blocks past the last group's (all zeros).
  row = jnp.arange(rows, dtype=jnp.int32)
  expert = jnp.minimum(_groups_ended(end, row), experts - 1)
  owner = jnp.minimum(_groups_ended(padded_end, jnp.arange(num_blocks, dtype=jnp.int32) * block),
                      experts - 1)
  slot = padded_start[expert] + row - start[expert]  # row -> its place in its group's blocks
  blocks = jnp.zeros((num_blocks * block, dim), x.dtype).at[slot].set(x, unique_indices=True)
  out = jnp.einsum("nbd,ndh->nbh", blocks.reshape(num_blocks, block, dim),
                   take_by_id(w, owner))
  # Each row reads its own slot: the gather's gradient is a scatter of unique indices.
  return out.reshape(num_blocks * block, -1).at[slot].get(unique_indices=True)


def _groups_ended(ends: jax.Array, positions: jax.Array) -> jax.Array:
  """(n,) int32: for each position, how many of the ascending `ends` are at or before it."""
  return jnp.sum(ends[None, :] <= positions[:, None], axis=1, dtype=jnp.int32)
