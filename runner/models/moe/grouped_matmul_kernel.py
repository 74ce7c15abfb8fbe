"""vmoe's grouped matmul as Pallas kernels for NVIDIA GPUs (Triton backend).

`grouped_matmul_pallas(x, w, group_sizes)` is `jax.lax.ragged_dot(x, w, group_sizes)`: rows of x
sorted by group, row r times the kernel of its group, rows past sum(group_sizes) zero. XLA lowers
ragged_dot densely on GPU, every row through every expert's kernel (E times the FLOPs); these
kernels do each row's product once, with float32 accumulation, under one `jax.custom_vjp`:
- out = x w and dx = dy w^T: a grid of (work item, column tile). A work item is a (group, tile
  of bm rows) pair, one for every row tile a non-empty group touches: at most ceil(M/bm) + E - 1
  of them, so the grid is static and the surplus items do nothing. Their metadata comes from
  cumulative sums and (items, E) comparisons: no sort, search, loop or scatter. A program runs
  its whole row tile (each row's product is its own) and stores only its group's rows, masking
  the others: the groups sharing a tile write disjoint rows of it. Rows past the groups, which
  no program writes, a `jnp.where` zeroes.
- dw[e] = x_e^T dy_e: a grid of (expert, D tile, H tile), each program looping over the aligned
  row tiles of its group with the rows outside it masked; an empty group writes zeros.
Dimensions that are not multiples of the (power-of-two, >= 16) blocks are padded with zeros.

Written for the Pallas of JAX 0.10.2 and 0.11.x (checked against the 0.11.1 sources: the same API
here); `_api` holds the names that older versions spell differently."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

ROWS, COLUMNS, DEPTH = 64, 128, 64  # the largest blocks: rows, output columns, contraction
NUM_WARPS, NUM_STAGES = 4, 3
_F32 = jnp.float32


def _api():
  """(compiler params, load, store) across Pallas versions: `plgpu.CompilerParams` and
  `plgpu.load/store(ref.at[idx])` (JAX 0.10, 0.11), or the older `plgpu.TritonCompilerParams` and
  `pl.load/store(ref, idx)`. Dots are `lax.dot_general` (not the deprecated `pl.dot`)."""
  params = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
  compiler_params = params(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
  if hasattr(plgpu, "load"):
    def load(ref, idx, mask=None):
      return plgpu.load(ref.at[idx], mask=mask, other=None if mask is None else 0)

    def store(ref, idx, value, mask=None):
      plgpu.store(ref.at[idx], value, mask=mask)
  else:
    def load(ref, idx, mask=None):
      return pl.load(ref, idx, mask=mask, other=None if mask is None else 0)

    def store(ref, idx, value, mask=None):
      pl.store(ref, idx, value, mask=mask)
  return compiler_params, load, store


_COMPILER_PARAMS, _load, _store = _api()


def _block(size: int, largest: int) -> int:
  """A power of two from 16 (Triton's smallest dot) to `largest`, no larger than size padded."""
  return max(16, min(largest, pl.next_power_of_2(size)))


def _pad(a: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
  widths = [(0, -n % m) for n, m in zip(a.shape, multiples)]
  return jnp.pad(a, widths) if any(w for _, w in widths) else a


def _dot(a, b, contract: tuple[int, int]):
  return jax.lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                             preferred_element_type=_F32)


def _group_bounds(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """[start_e, end_e) of each group's rows, clipped to the rows there are."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.minimum(ends - group_sizes, rows), jnp.minimum(ends, rows)


def work_items(group_sizes: jax.Array, rows: int, bm: int) -> jax.Array:
  """(4, ceil(rows / bm) + E - 1) int32: each work item's group, row tile, and [lo, hi) the rows
  of its group; surplus items have lo == hi == 0. Items run group by group, tiles in order."""
  experts = group_sizes.shape[0]
  starts, ends = _group_bounds(group_sizes, rows)
  first_tile = starts // bm
  tiles = jnp.where(ends > starts, (ends + bm - 1) // bm - first_tile, 0)
  items_end = jnp.cumsum(tiles)
  item = jnp.arange(-(-rows // bm) + experts - 1, dtype=jnp.int32)
  group = jnp.sum(items_end[None, :] <= item[:, None], axis=1, dtype=jnp.int32)  # E: surplus
  mine = group[:, None] == jnp.arange(experts)[None, :]

  def pick(per_group):  # per item, its group's value; 0 for surplus items
    return jnp.sum(jnp.where(mine, per_group[None, :], 0), axis=1, dtype=jnp.int32)
  lo, hi = pick(starts), pick(ends)
  tile = jnp.where(hi > lo, pick(first_tile) + item - pick(items_end - tiles), 0)
  return jnp.stack([jnp.minimum(group, experts - 1), tile, lo, hi])


def _rows_kernel(items_ref, x_ref, w_ref, out_ref, *, bm, bn, bk, transposed):
  """out[rows of item i, column tile j] = x[those rows] @ w[group] (w[group]^T if transposed).
  Each row's product is its own, so the whole row tile is loaded and only the store is masked."""
  item, j = pl.program_id(0), pl.program_id(1)
  group, tile, lo, hi = (items_ref[k, item] for k in range(4))

  @pl.when(hi > lo)
  def _():
    row = tile * bm + jnp.arange(bm)
    mine = ((row >= lo) & (row < hi))[:, None]
    rows, cols = pl.ds(tile * bm, bm), pl.ds(j * bn, bn)

    def accumulate(k, acc):
      depth = pl.ds(k * bk, bk)
      x = _load(x_ref, (rows, depth))
      if transposed:
        return acc + _dot(x, _load(w_ref, (group, cols, depth)), (1, 1))
      return acc + _dot(x, _load(w_ref, (group, depth, cols)), (1, 0))
    acc = jax.lax.fori_loop(0, x_ref.shape[1] // bk, accumulate, jnp.zeros((bm, bn), _F32))
    _store(out_ref, (rows, cols), acc.astype(out_ref.dtype), mask=mine)


def _rows_call(items, x, w, *, bm, bn, bk, transposed, interpret):
  """The padded grouped product: x (M', K'), w (E, K', N') or (E, N', K') -> (M', N')."""
  cols = w.shape[1] if transposed else w.shape[2]
  kernel = functools.partial(_rows_kernel, bm=bm, bn=bn, bk=bk, transposed=transposed)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], cols), x.dtype),
      grid=(items.shape[1], cols // bn), compiler_params=_COMPILER_PARAMS,
      interpret=interpret, name="grouped_matmul_rows")(items, x, w)


def _grouped_rows(x, w, group_sizes, *, transposed, interpret):
  """Row r of x (M, K) times w[group of r] (E, K, N), or its transpose if w is (E, N, K)."""
  (rows, depth), cols = x.shape, w.shape[1 if transposed else 2]
  bm, bn, bk = _block(rows, ROWS), _block(cols, COLUMNS), _block(depth, DEPTH)
  x = _pad(x, (bm, bk))
  w = _pad(w, (1, bn, bk) if transposed else (1, bk, bn))
  out = _rows_call(work_items(group_sizes, rows, bm), x, w, bm=bm, bn=bn, bk=bk,
                   transposed=transposed, interpret=interpret)[:rows, :cols]
  total = jnp.minimum(jnp.sum(group_sizes), rows)
  return jnp.where(jnp.arange(rows)[:, None] < total, out, 0)


def _experts_kernel(bounds_ref, x_ref, dy_ref, dw_ref, *, bm, bd, bh):
  """dw[e, D tile a, H tile b] = sum over the row tiles of group e of x^T dy, rows masked."""
  e, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  lo, hi = bounds_ref[0, e], bounds_ref[1, e]

  def accumulate(tile, acc):
    row = tile * bm + jnp.arange(bm)
    mine = ((row >= lo) & (row < hi))[:, None]
    rows = pl.ds(tile * bm, bm)
    x = _load(x_ref, (rows, pl.ds(a * bd, bd)), mask=mine)
    dy = _load(dy_ref, (rows, pl.ds(b * bh, bh)), mask=mine)
    return acc + _dot(x, dy, (0, 0))
  acc = jax.lax.fori_loop(lo // bm, (hi + bm - 1) // bm, accumulate, jnp.zeros((bd, bh), _F32))
  _store(dw_ref, (e, pl.ds(a * bd, bd), pl.ds(b * bh, bh)), acc.astype(dw_ref.dtype))


def _grouped_experts(x, dy, group_sizes, *, interpret):
  """dw (E, D, H): dw[e] = x_e^T dy_e over the rows of group e."""
  (rows, dim), hidden, experts = x.shape, dy.shape[1], group_sizes.shape[0]
  bm, bd, bh = _block(rows, ROWS), _block(dim, DEPTH), _block(hidden, COLUMNS)
  x, dy = _pad(x, (bm, bd)), _pad(dy, (bm, bh))
  kernel = functools.partial(_experts_kernel, bm=bm, bd=bd, bh=bh)
  dw = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((experts, x.shape[1], dy.shape[1]), x.dtype),
      grid=(experts, x.shape[1] // bd, dy.shape[1] // bh), compiler_params=_COMPILER_PARAMS,
      interpret=interpret, name="grouped_matmul_experts",
  )(jnp.stack(_group_bounds(group_sizes, rows)), x, dy)
  return dw[:, :dim, :hidden]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(x, w, group_sizes, interpret):
  return _grouped_rows(x, w, group_sizes, transposed=False, interpret=interpret)


def _forward(x, w, group_sizes, interpret):
  return _grouped_matmul(x, w, group_sizes, interpret), (x, w, group_sizes)


def _backward(interpret, residuals, dy):
  x, w, group_sizes = residuals
  dx = _grouped_rows(dy, w, group_sizes, transposed=True, interpret=interpret)
  dw = _grouped_experts(x, dy, group_sizes, interpret=interpret)
  return dx.astype(x.dtype), dw.astype(w.dtype), None


_grouped_matmul.defvjp(_forward, _backward)


def grouped_matmul_pallas(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                          interpret: bool = False) -> jax.Array:
  """x: (M, D) rows sorted by group, group_sizes[e] of them group e's; w: (E, D, H) -> (M, H) in
  x's dtype, `jax.lax.ragged_dot(x, w, group_sizes)`, with its gradients wrt x and w.
  interpret: run the kernels in Pallas's interpreter (any backend; for tests)."""
  return _grouped_matmul(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), interpret)
