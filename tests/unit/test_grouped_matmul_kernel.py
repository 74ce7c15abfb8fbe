"""vmoe's Pallas grouped matmul (runner/models/moe/grouped_matmul_kernel.py), in Pallas's interpreter
on the CPU: its work items against a NumPy listing; values and gradients against NumPy and
`jax.lax.ragged_dot`, in float32 and bfloat16, for empty groups (first, middle, last), groups that
are not multiples of a tile, tiles shared by several groups, and rows past the groups; that a NaN
in a row reaches only that row's outputs and its group's dw; that a work item writes its group's
rows and no others; and that the kernels lower for CUDA with no sort, loop, scatter or dense
matmul around them."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu

from runner.models.moe import grouped_matmul_kernel as gmk

ROWS, DIM, HIDDEN, EXPERTS = 150, 72, 136, 8  # no dimension a multiple of its block
SIZES = {
    "uneven": [0, 5, 17, 0, 3, 40, 70, 0],  # empty first, middle, last; 15 rows past the groups
    "one group": [0, 0, 0, 150, 0, 0, 0, 0],
    "eight groups in a tile": [1] * 8,
    "no rows": [0] * 8,
    "every item used": [10, 20, 30, 10, 20, 30, 15, 15],  # no group boundary on a tile's
    "tile-aligned": [16, 48, 0, 64, 0, 0, 0, 22],  # groups ending on tiles of 16 and 64 rows
}


def _numpy(x, w, sizes, dy):
  """out, dx, dw of the grouped matmul, group by group in float64."""
  x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
  out, dx, dw = np.zeros((len(x), w.shape[2])), np.zeros_like(x), np.zeros_like(w)
  start = 0
  for e, n in enumerate(sizes):
    rows = slice(start, start + n)
    out[rows], dx[rows], dw[e] = x[rows] @ w[e], dy[rows] @ w[e].T, x[rows].T @ dy[rows]
    start += n
  return out, dx, dw


def _items_numpy(sizes, rows, bm):
  """(group, tile, lo, hi) for each row tile of each non-empty group, in order."""
  items, start = [], 0
  for e, n in enumerate(sizes):
    items += [(e, t, start, start + n) for t in range(start // bm, -(-(start + n) // bm)) if n]
    start += n
  return items


@pytest.mark.parametrize("bm", [16, 64])
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_work_items_are_each_groups_row_tiles_then_nothing(sizes, bm):
  items = np.asarray(gmk.work_items(jnp.asarray(sizes, jnp.int32), ROWS, bm))
  expected = _items_numpy(sizes, ROWS, bm)
  assert items.shape == (4, -(-ROWS // bm) + EXPERTS - 1)
  active = items[3] > items[2]
  assert active.sum() == len(expected)
  np.testing.assert_array_equal(items[:, :len(expected)].T, np.asarray(expected).reshape(-1, 4))
  np.testing.assert_array_equal(items[1:, len(expected):], 0)  # surplus: tile 0, no rows
  if sizes == SIZES["every item used"] and bm == 64:
    assert active.all()  # the grid's ceil(M / bm) + E - 1 items can all be needed


@jax.jit
def _kernel_and_ragged_dot(x, w, sizes, dy):
  """(out, dx, dw) of the kernel in the interpreter, and of ragged_dot."""
  def value_and_grads(fn):
    out, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
    return (out, *vjp(dy))
  kernel = functools.partial(gmk.grouped_matmul_pallas, interpret=True)
  return value_and_grads(kernel), value_and_grads(jax.lax.ragged_dot)


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_values_and_gradients_are_numpys_and_ragged_dots(sizes, dtype, rtol):
  rng = np.random.default_rng(0)
  x, w, dy = (jnp.asarray(rng.standard_normal(s), dtype)
              for s in ((ROWS, DIM), (EXPERTS, DIM, HIDDEN), (ROWS, HIDDEN)))
  kernel, ragged = _kernel_and_ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), dy)
  for name, got, numpy, ragged_dot in zip(("out", "dx", "dw"), kernel, _numpy(x, w, sizes, dy),
                                          ragged):
    assert got.dtype == dtype, name
    got = np.asarray(got, np.float64)
    scale = max(1.0, np.abs(numpy).max())
    np.testing.assert_allclose(got, numpy, rtol=rtol, atol=rtol * scale, err_msg=name)
    np.testing.assert_allclose(got, np.asarray(ragged_dot, np.float64), rtol=rtol,
                               atol=rtol * scale, err_msg=name)
  total = sum(sizes)
  assert not np.asarray(kernel[0][total:]).any() and not np.asarray(kernel[1][total:]).any()


def test_a_rows_nan_reaches_only_its_own_outputs():
  # NaN in row 10 (group 2, in a tile shared with groups 1, 4 and 5) and in row 140 (past the
  # groups): out and dx of row 10 and dw of group 2 are NaN, the rest is as without them.
  sizes = SIZES["uneven"]
  rng = np.random.default_rng(2)
  x, w, dy = (rng.standard_normal(s).astype(np.float32)
              for s in ((ROWS, DIM), (EXPERTS, DIM, HIDDEN), (ROWS, HIDDEN)))
  x[[10, 140], 3] = dy[[10, 140], 5] = np.nan
  kernel, _ = _kernel_and_ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), dy)
  for name, got, numpy in zip(("out", "dx", "dw"), kernel, _numpy(x, w, sizes, dy)):
    assert np.isnan(numpy).any() and not np.isnan(numpy).all(), name
    np.testing.assert_allclose(np.asarray(got), numpy, rtol=1e-5, atol=1e-4, err_msg=name)


def test_a_work_item_writes_its_groups_rows_and_no_others():
  # The interpreter fills the output with NaN before the kernel runs: rows left NaN are rows no
  # program wrote. With only one group's items active, exactly that group's rows are written.
  sizes, bm, bn, bk = SIZES["uneven"], 64, 64, 64
  rng = np.random.default_rng(1)
  x = rng.standard_normal((192, 64)).astype(np.float32)  # padded already: 3 tiles of bm rows
  w = rng.standard_normal((EXPERTS, 64, 128)).astype(np.float32)  # 2 column tiles of bn
  items = np.asarray(gmk.work_items(jnp.asarray(sizes, jnp.int32), 192, bm))
  rows_call = jax.jit(functools.partial(gmk._rows_call, bm=bm, bn=bn, bk=bk, transposed=False,
                                        interpret=True))
  expected, _, _ = _numpy(x, w, sizes, np.zeros((192, 128)))
  start = np.cumsum(sizes) - sizes
  for group in [None] + [e for e, n in enumerate(sizes) if n]:
    only = items.copy()
    only[2:, items[0] != group] = 0
    out = np.asarray(rows_call(jnp.asarray(only), jnp.asarray(x), jnp.asarray(w)))
    mine = np.zeros(192, bool)
    if group is not None:
      mine[start[group]:start[group] + sizes[group]] = True
    assert np.isnan(out[~mine]).all(), group
    np.testing.assert_allclose(out[mine], expected[mine], rtol=1e-5, atol=1e-4)


def test_the_kernels_lower_for_cuda_with_no_sort_loop_scatter_or_dense_matmul():
  target = getattr(plgpu, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")

  def value_and_grads(x, w, sizes):
    out, vjp = jax.vjp(lambda x, w: gmk.grouped_matmul_pallas(x, w, sizes), x, w)
    return out, vjp(out)
  args = (jax.ShapeDtypeStruct((ROWS, DIM), jnp.bfloat16),
          jax.ShapeDtypeStruct((EXPERTS, DIM, HIDDEN), jnp.bfloat16),
          jax.ShapeDtypeStruct((EXPERTS,), jnp.int32))
  try:
    exported = jax.export.export(
        jax.jit(value_and_grads), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)])(*args)
  except RuntimeError as e:  # a jaxlib that compiles the Triton IR when lowering needs a GPU's
    if "does not have a Triton compilation handler" in str(e):
      pytest.skip(f"this jaxlib compiles Triton kernels while lowering: {e}")
    raise
  text = exported.mlir_module()
  assert text.count(f"stablehlo.custom_call @{target}(") == 3  # out, dx, dw
  assert text.count('name = "grouped_matmul_rows"') == 2
  assert text.count('name = "grouped_matmul_experts"') == 1
  for op in ("stablehlo.sort", "stablehlo.while", "stablehlo.scatter", "stablehlo.dot_general"):
    assert op not in text, op
