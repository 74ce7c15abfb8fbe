"""The grouped matmul of dropless routing (runner/models/moe/grouped_matmul.py) against NumPy: row
r of x times the kernel of its group, by blocks and by ragged_dot, values and gradients, for group
sizes with empty groups, one group holding every row, and sizes that are not multiples of a block;
what "auto" takes, and that `model.moe.grouped_matmul` reaches the compiled program."""
from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.accelerator import GPU_GROUPED_MATMULS, grouped_matmul_problem
from runner.config.schema import DType, GroupedMatmul
from runner.config.validate import problems
from runner.errors import ConfigError
from runner.models import build_model, model_config
from runner.models.moe import grouped_matmul as gm

SIZES = {"uneven": [5, 0, 17, 1, 0, 9, 31, 1], "one group": [0, 0, 64, 0, 0, 0, 0, 0],
         "even": [8] * 8}


def _numpy(x, w, sizes):
  group = np.repeat(np.arange(len(sizes)), sizes)
  return np.einsum("md,mdh->mh", x, w[group])


@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
@pytest.mark.parametrize("method", [m for m in gm.METHODS if m not in GPU_GROUPED_MATMULS])
def test_each_row_is_multiplied_by_its_groups_kernel(sizes, method):
  """On the CPU: pallas runs in interpret mode in test_grouped_matmul_kernel.py, cudnn is
  ragged_dot compiled with an option the CPU ignores."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((sum(sizes), 6)).astype(np.float32)
  w = rng.standard_normal((len(sizes), 6, 5)).astype(np.float32)
  out = gm.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32), method)
  np.testing.assert_allclose(np.asarray(out), _numpy(x, w, sizes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [1, 4, 16])
def test_blocks_of_any_size_give_ragged_dots_values_and_gradients(block):
  rng = np.random.default_rng(1)
  sizes = jnp.asarray(SIZES["uneven"], jnp.int32)
  x = jnp.asarray(rng.standard_normal((64, 6)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((8, 6, 5)), jnp.float32)
  target = jnp.asarray(rng.standard_normal((64, 5)), jnp.float32)

  def loss(fn):
    return lambda x, w: jnp.sum((fn(x, w) - target) ** 2)
  by_blocks = loss(lambda x, w: gm._by_blocks(x, w, sizes, block))
  ragged = loss(lambda x, w: jax.lax.ragged_dot(x, w, sizes))
  np.testing.assert_allclose(by_blocks(x, w), ragged(x, w), rtol=1e-5)
  for a, b in zip(jax.grad(by_blocks, (0, 1))(x, w), jax.grad(ragged, (0, 1))(x, w)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_the_block_keeps_padding_within_a_quarter_of_the_rows():
  assert gm.block_rows(16384, 8) == 512 and gm.block_rows(16384, 32) == 128
  assert gm.block_rows(100, 8) == 16  # never below 16 rows
  for rows, experts in ((16384, 8), (16384, 32), (65536, 8), (4096, 16)):
    assert experts * gm.block_rows(rows, experts) <= rows // 4


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's lowering of ragged_dot")
def test_on_cpu_the_default_costs_about_the_rows_own_flops_not_e_times_them():
  """XLA's count of the compiled default: within the blocks' padding of 2*M*D*H, where the
  CPU's ragged_dot multiplies every row by all E kernels."""
  rows, dim, hidden, experts = 4096, 32, 64, 16
  args = (jnp.ones((rows, dim)), jnp.ones((experts, dim, hidden)),
          jnp.full((experts,), rows // experts, jnp.int32))

  def flops(fn):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
  own = 2 * rows * dim * hidden
  assert flops(gm.grouped_matmul) <= 1.5 * own
  assert flops(jax.lax.ragged_dot) >= 0.9 * experts * own  # what the blocks avoid


def test_an_unknown_method_is_an_error():
  with pytest.raises(ValueError, match="valid"):
    gm.grouped_matmul(jnp.ones((2, 2)), jnp.ones((1, 2, 2)), jnp.asarray([2]), "dense")


def test_auto_takes_a_method_only_where_it_is_recorded_fastest(monkeypatch):
  assert gm.AUTO == {}  # no bench-gpu row has shown another method ahead of blocks yet
  assert gm.resolve("auto") == "blocks" and gm.resolve("ragged_dot") == "ragged_dot"
  monkeypatch.setattr(gm, "AUTO", {jax.default_backend(): "pallas"})
  assert gm.resolve("auto") == "pallas" and gm.resolve("blocks") == "blocks"
  monkeypatch.setattr(gm, "AUTO", {"some other backend": "pallas"})
  assert gm.resolve("auto") == "blocks"


def test_cudnn_is_ragged_dot_with_the_fusions_compiler_option_and_the_others_need_none():
  assert gm.compiler_options("cudnn") == {"xla_gpu_experimental_use_ragged_dot_fusion": True}
  for method in ("auto", "blocks", "ragged_dot", "pallas"):
    assert gm.compiler_options(method) == {}


@pytest.mark.parametrize("method, dtype, platform, said", [
    ("cudnn", "float32", None, "cuDNN's grouped matmul takes bfloat16 inputs, and "
                               "model.dtype=float32"),
    ("cudnn", "bfloat16", "cpu", "it needs an NVIDIA GPU, and this process computes on cpu"),
    ("pallas", "float32", "cpu", "it needs an NVIDIA GPU, and this process computes on cpu"),
    ("pallas", "bfloat16", "rocm", "it needs an NVIDIA GPU, and this process computes on rocm"),
])
def test_the_gpu_methods_say_why_they_cannot_run(method, dtype, platform, said):
  found = grouped_matmul_problem(method, dtype, platform)
  assert found.startswith(f"model.moe.grouped_matmul={method} cannot run here: {said}. ")
  assert "blocks or ragged_dot" in found


@pytest.mark.parametrize("method, dtype", [("pallas", "float32"), ("pallas", "bfloat16"),
                                           ("cudnn", "bfloat16"), ("blocks", "float32"),
                                           ("ragged_dot", "float32"), ("auto", "float32")])
def test_what_can_run_on_a_gpu_is_not_refused(method, dtype):
  assert grouped_matmul_problem(method, dtype, "cuda") is None and grouped_matmul_problem(method, dtype) is None


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's lowering of ragged_dot")
def test_the_config_key_chooses_the_compiled_method():
  """model.moe.grouped_matmul reaches the dropless layer: XLA counts E times the experts' FLOPs
  in the forward pass with ragged_dot (the CPU's dense lowering), not with auto (blocks)."""
  config = model_config("vmoe_tiny")
  config = dataclasses.replace(config, router=dataclasses.replace(config.router, dropless=True))

  def flops(method: str) -> float:
    model = build_model(dataclasses.replace(config, moe=dataclasses.replace(
        config.moe, grouped_matmul=GroupedMatmul(method))), 10)
    images = jnp.ones((8, 32, 32, 3))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), images, train=False))
    forward = jax.jit(lambda p, x: model.apply(p, x, train=False)[0])
    cost = forward.lower(params, images).compile().cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
  blocks, ragged = flops("auto"), flops("ragged_dot")
  assert flops("blocks") == blocks
  assert ragged > 2 * blocks  # 8 experts: the dense product is 8x the experts' own


@pytest.mark.parametrize("shape", [(5,), (3, 4)], ids=["bias rows", "block kernels"])
def test_take_by_id_has_the_gathers_gradient_without_its_scatter(shape):
  """Its gradient, a one-hot product in float32, equals autodiff of the gather (a scatter-add) in
  float32 to rounding; in bfloat16 it is the float32 sum rounded once, closer to the exact sum
  than the gather's bfloat16 scatter-add."""
  rng = np.random.default_rng(5)
  ids = jnp.asarray(rng.integers(0, 4, size=64), jnp.int32)  # every id repeats
  table = jnp.asarray(rng.standard_normal((4,) + shape), jnp.float32)
  cotangent = rng.standard_normal((64,) + shape)
  exact = np.zeros((4,) + shape)
  np.add.at(exact, np.asarray(ids), cotangent)

  def grad(fn, dtype):
    _, vjp = jax.vjp(lambda t: fn(t, ids), table.astype(dtype))
    return np.asarray(vjp(jnp.asarray(cotangent, dtype))[0], np.float64)
  np.testing.assert_array_equal(np.asarray(gm.take_by_id(table, ids)), np.asarray(table[ids]))
  np.testing.assert_allclose(grad(gm.take_by_id, jnp.float32),
                             grad(lambda t, i: t[i], jnp.float32), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(grad(gm.take_by_id, jnp.float32), exact, rtol=1e-6, atol=1e-6)
  ours = np.abs(grad(gm.take_by_id, jnp.bfloat16) - exact).max()
  assert ours <= np.abs(exact).max() * 2**-8  # one bfloat16 rounding of the float32 sum


def test_the_blocks_gradients_hold_no_colliding_scatter():
  """The blocks method's program, forward and backward: every scatter declares unique indices
  (the rows' slots), none adds colliding updates (the kernels' and biases' sums are matmuls)."""
  sizes = jnp.asarray(SIZES["uneven"], jnp.int32)

  def loss(x, w):
    return jnp.sum(gm.grouped_matmul(x, w, sizes, "blocks") ** 2)
  text = jax.jit(jax.grad(loss, (0, 1))).lower(jnp.ones((64, 6)), jnp.ones((8, 6, 5))).as_text()
  assert "stablehlo.while" not in text and "stablehlo.sort" not in text
  for start in [i for i in range(len(text)) if text.startswith('"stablehlo.scatter"', i)]:
    assert "unique_indices = true" in text[start:text.index("}>", start)]


def _dropless(method: str, dtype: str = "float32"):
  config = model_config("vmoe_tiny")
  return dataclasses.replace(
      config, dtype=DType(dtype), router=dataclasses.replace(config.router, dropless=True),
      moe=dataclasses.replace(config.moe, grouped_matmul=GroupedMatmul(method)))


@pytest.mark.parametrize("method, dtype", [("pallas", "float32"), ("cudnn", "bfloat16")])
def test_a_gpu_method_on_a_cpu_is_refused_when_traced_before_compute(method, dtype):
  config = _dropless(method, dtype)
  assert not problems(types.SimpleNamespace(model=config))  # fine until the device
  with pytest.raises(ConfigError, match=f"model.moe.grouped_matmul={method} cannot run here: it "
                                        "needs an NVIDIA GPU, and this process computes on cpu"):
    jax.eval_shape(lambda: build_model(config, 10).init(
        jax.random.key(0), jnp.ones((8, 32, 32, 3)), train=False))


def test_cudnn_in_float32_is_a_config_error():
  found = problems(types.SimpleNamespace(model=_dropless("cudnn")))
  assert len(found) == 1 and found[0].startswith(
      "model.moe.grouped_matmul=cudnn cannot run here: cuDNN's grouped matmul takes bfloat16 "
      "inputs, and model.dtype=float32.")
  assert not problems(types.SimpleNamespace(model=_dropless("pallas")))
