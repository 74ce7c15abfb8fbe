"""The grouped matmul of dropless routing: rows sorted by expert, each through its expert's kernel.

XLA lowers `jax.lax.ragged_dot` densely, every row with every expert's kernel (E times the FLOPs;
docs/routers.md), so `grouped_matmul` runs every block of B rows through its expert's kernel in
one batched matmul, as MegaBlocks does; "auto" takes ragged_dot only where measured grouped."""
from __future__ import annotations

import jax
import jax.numpy as jnp

METHODS = ("auto", "blocks", "ragged_dot")
# Backends (jax.default_backend()) whose ragged_dot is measured to be grouped: none (jaxlib 0.10).
RAGGED_DOT_IS_GROUPED: frozenset[str] = frozenset()


def resolve(method: str = "auto") -> str:
  """The method "auto" stands for on this backend; any other method as given."""
  if method not in METHODS:
    raise ValueError(f"unknown grouped matmul {method!r}; valid: {METHODS}")
  if method != "auto":
    return method
  return "ragged_dot" if jax.default_backend() in RAGGED_DOT_IS_GROUPED else "blocks"


def block_rows(rows: int, experts: int) -> int:
  """B, a power of two near rows / (4 E): the padding (at most E*B rows) stays within a quarter of
  the rows, and the blocks large enough to be efficient matmuls (16 to 512 rows)."""
  target = max(1, rows // (4 * experts))
  return int(min(512, max(16, 1 << (target.bit_length() - 1))))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   method: str = "auto") -> jax.Array:
  """x: (M, D) rows sorted by group, group_sizes[e] of them group e's; w: (E, D, H) -> (M, H),
  row r times the kernel of its group: `jax.lax.ragged_dot(x, w, group_sizes)`."""
  if resolve(method) == "ragged_dot":
    return jax.lax.ragged_dot(x, w, group_sizes)
  return _by_blocks(x, w, group_sizes, block_rows(x.shape[0], w.shape[0]))


def _by_blocks(x: jax.Array, w: jax.Array, group_sizes: jax.Array, block: int) -> jax.Array:
  rows, dim = x.shape
  experts = w.shape[0]
  num_blocks = -(-rows // block) + experts  # enough for every expert's last, partial block
  group_sizes = group_sizes.astype(jnp.int32)
  padded = (group_sizes + block - 1) // block * block
  padded_end = jnp.cumsum(padded)
  start, padded_start = jnp.cumsum(group_sizes) - group_sizes, padded_end - padded
  expert = jnp.repeat(jnp.arange(experts, dtype=jnp.int32), group_sizes, total_repeat_length=rows)
  slot = padded_start[expert] + jnp.arange(rows, dtype=jnp.int32) - start[expert]  # row -> slot
  blocks = jnp.zeros((num_blocks * block, dim), x.dtype).at[slot].set(x, unique_indices=True)
  # The expert of each block; blocks past the last expert's (all zeros) take the last kernel.
  owner = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(num_blocks) * block, side="right"),
                      experts - 1)
  out = jnp.einsum("nbd,ndh->nbh", blocks.reshape(num_blocks, block, dim), w[owner])
  return out.reshape(num_blocks * block, -1)[slot]
