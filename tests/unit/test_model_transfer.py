"""adapt_params: mapping a checkpoint's parameters onto a new model for fine-tuning.

Parameter trees come from jax.eval_shape of tiny models filled with random NumPy values, so no
model is compiled here.
"""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from scipy import ndimage

from runner.checkpoints.checkpoint import CheckpointError
from runner.config import from_dict
from runner.config.schema import ModelConfig
from runner.models import build_model
from runner.models.transfer import adapt_params, flatten, resize_position_embedding
from runner.train.state import abstract_params

# Plain values of the model keys; random_tree types them (image sizes come from `image`).
BASE = dict(patch_size=2, hidden_size=8, num_layers=2, mlp_dim=16, num_heads=2)


def random_tree(config, num_classes, image, seed):
  typed = from_dict(ModelConfig, dict(config, name="transfer_test", image_size=image[0]))
  shapes, _ = abstract_params(build_model(typed, num_classes), image)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)


@pytest.fixture(scope="module")
def dense_ckpt():
  """A 'pre-trained' dense model: 8x8 images, patch 2 -> a 4x4 grid, 10 classes."""
  return random_tree(BASE, 10, (8, 8, 3), seed=0)


def test_reinit_head_takes_the_fresh_head_and_copies_the_rest(dense_ckpt):
  fresh = random_tree(BASE, 3, (8, 8, 3), seed=1)
  out = adapt_params(dense_ckpt, fresh, reinit_head=True)
  old, new, got = flatten(dense_ckpt), flatten(fresh), flatten(out)
  assert got.keys() == new.keys()
  for name, value in got.items():
    assert isinstance(value, np.ndarray)
    want = new[name] if name.startswith("head/") else old[name]
    np.testing.assert_array_equal(value, want, err_msg=name)
  assert got["head/kernel"].shape == (8, 3)
  # Same number of classes: the head is still re-initialised when asked.
  same = random_tree(BASE, 10, (8, 8, 3), seed=2)
  out = flatten(adapt_params(dense_ckpt, same, reinit_head=True))
  np.testing.assert_array_equal(out["head/kernel"], flatten(same)["head/kernel"])
  # ... and kept when not.
  out = flatten(adapt_params(dense_ckpt, same, reinit_head=False))
  np.testing.assert_array_equal(out["head/kernel"], old["head/kernel"])
  np.testing.assert_array_equal(out["head/bias"], old["head/bias"])


def _problem(message, name):
  """The part of a CheckpointError message about parameter `name` (problems are '; '-separated)."""
  for part in re.split(r"; |: (?=[\w/]+: )", message):
    if part.startswith(name + ":") or f" {name}:" in part:
      return part[part.index(name):]
  raise AssertionError(f"{name!r} not reported in: {message}")


def _count(message):
  return int(re.search(r"\((\d+) parameter\(s\)\)", message)[1])


def test_new_number_of_classes_without_reinit_head_is_reported(dense_ckpt):
  fresh = random_tree(BASE, 3, (8, 8, 3), seed=1)
  with pytest.raises(CheckpointError) as e:
    adapt_params(dense_ckpt, fresh, reinit_head=False, source="checkpoint runs/up (step 7)")
  message = str(e.value)
  assert "checkpoint runs/up (step 7)" in message
  kernel = _problem(message, "head/kernel")
  assert "(8, 10)" in kernel and "(8, 3)" in kernel
  assert "init.reinit_head=true" in kernel
  bias = _problem(message, "head/bias")
  assert "(10,)" in bias and "(3,)" in bias
  assert _count(message) == 2


def _upsampled_coordinate(new_index, old_side=4, new_side=8):
  """Source coordinate of output cell `new_index` in scipy.ndimage.zoom's default (corner-aligned)
  convention, j * (old - 1) / (new - 1): the first and last cells sample the old corners."""
  return new_index * (old_side - 1) / (new_side - 1)


def test_position_embedding_of_a_linear_function_stays_linear(dense_ckpt):
  # pos[i, j, c] = a_c * i + b_c * j + c0_c on the 4x4 grid (row-major tokens, as in embed()).
  d = 8
  rng = np.random.default_rng(3)
  a, b, c0 = rng.normal(size=d), rng.normal(size=d), rng.normal(size=d)
  i, j = np.meshgrid(np.arange(4), np.arange(4), indexing="ij")
  grid = a * i[..., None] + b * j[..., None] + c0
  restored = jax.tree.map(np.copy, dense_ckpt)
  restored["pos_embedding"] = grid.reshape(1, 16, d).astype(np.float32)
  fresh = random_tree(BASE, 10, (16, 16, 3), seed=4)  # 16x16 images: an 8x8 grid
  assert fresh["pos_embedding"].shape == (1, 64, d)
  out = adapt_params(restored, fresh, reinit_head=True)["pos_embedding"]
  assert out.shape == (1, 64, d) and out.dtype == np.float32
  u = _upsampled_coordinate(np.arange(8))
  np.testing.assert_allclose(u, np.arange(8) * 3 / 7)
  want = a * u[:, None, None] + b * u[None, :, None] + c0
  np.testing.assert_allclose(out.reshape(8, 8, d), want, rtol=1e-5, atol=1e-5)
  # Corner-aligned: linear up to the edges (no clamped border), constant differences everywhere.
  grid8 = out.reshape(8, 8, d)
  np.testing.assert_allclose(np.diff(grid8, axis=0), np.broadcast_to(a * 3 / 7, (7, 8, d)),
                             atol=1e-5)
  np.testing.assert_allclose(np.diff(grid8, axis=1), np.broadcast_to(b * 3 / 7, (8, 7, d)),
                             atol=1e-5)
  # The cls token is not part of the grid and is copied unchanged.
  np.testing.assert_array_equal(adapt_params(restored, fresh)["cls"], dense_ckpt["cls"])


def _numpy_align_corners(grid, new_side):
  """Separable linear interpolation, new cell j at old coordinate j * (n - 1) / (m - 1)."""
  old_side = grid.shape[0]
  src = np.arange(new_side) * (old_side - 1) / (new_side - 1)
  lo = np.minimum(np.floor(src).astype(int), old_side - 2)
  w = (src - lo)[:, None]
  rows = grid[lo] * (1 - w[..., None]) + grid[lo + 1] * w[..., None]
  w = w[None, :, :]
  return rows[:, lo] * (1 - w) + rows[:, lo + 1] * w


@pytest.mark.parametrize("old_side,new_side", [(4, 8), (3, 7), (14, 24), (24, 14), (7, 12)])
def test_resize_position_embedding_is_big_vision_resample_posemb(old_side, new_side):
  d = 5
  posemb = np.random.default_rng(5).normal(size=(1, old_side ** 2, d)).astype(np.float32)
  got = resize_position_embedding(posemb, new_side ** 2)
  assert got.shape == (1, new_side ** 2, d) and got.dtype == np.float32
  grid = posemb.reshape(old_side, old_side, d)
  # big_vision's resample_posemb (and vmoe's VitZoomTransformation), called directly.
  want = ndimage.zoom(grid, (new_side / old_side, new_side / old_side, 1), order=1)
  np.testing.assert_allclose(got.reshape(new_side, new_side, d), want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got.reshape(new_side, new_side, d),
                             _numpy_align_corners(grid.astype(np.float64), new_side),
                             rtol=1e-5, atol=1e-6)
  # The four corner embeddings are kept exactly.
  out = got.reshape(new_side, new_side, d)
  for r, c in ((0, 0), (0, -1), (-1, 0), (-1, -1)):
    np.testing.assert_array_equal(out[r, c], grid[r, c])
  # Not the half-pixel convention of jax.image.resize (the old implementation).
  half_pixel = np.asarray(jax.image.resize(grid, (new_side, new_side, d), method="bilinear"))
  assert not np.allclose(out, half_pixel, atol=1e-3)


def test_resize_position_embedding_same_size_and_dtype():
  posemb = np.random.default_rng(6).normal(size=(1, 9, 4)).astype(np.float32)
  np.testing.assert_array_equal(resize_position_embedding(posemb, 9), posemb)
  as64 = resize_position_embedding(posemb.astype(np.float64), 25)
  assert as64.dtype == np.float64


def test_resize_position_embedding_rejects_non_square_grids():
  with pytest.raises(ValueError, match="not square"):
    resize_position_embedding(np.zeros((1, 12, 4), np.float32), 16)


VMOE = dict(BASE, moe=dict(layers=[1], num_experts=3, group_size=1), router=dict(k=1))


def test_dense_to_experts_copies_the_dense_mlp_into_every_expert(dense_ckpt):
  fresh = random_tree(VMOE, 5, (8, 8, 3), seed=6)
  out = adapt_params(dense_ckpt, fresh, reinit_head=True, dense_to_experts=True)
  assert flatten(out).keys() == flatten(fresh).keys()
  experts = out["block_1"]["moe"]["experts"]
  dense = dense_ckpt["block_1"]["mlp"]
  assert experts["fc1_kernel"].shape == (3, 8, 16)
  for e in range(3):
    np.testing.assert_array_equal(experts["fc1_kernel"][e], dense["fc1"]["kernel"])
    np.testing.assert_array_equal(experts["fc1_bias"][e], dense["fc1"]["bias"])
    np.testing.assert_array_equal(experts["fc2_kernel"][e], dense["fc2"]["kernel"])
    np.testing.assert_array_equal(experts["fc2_bias"][e], dense["fc2"]["bias"])
  # Writable, independent copies (not read-only broadcast views).
  experts["fc1_kernel"][0, 0, 0] += 1.0
  assert experts["fc1_kernel"][1, 0, 0] == dense["fc1"]["kernel"][0, 0]
  # The router keeps its fresh initialisation; the dense block 0 and the rest are copied.
  np.testing.assert_array_equal(out["block_1"]["moe"]["router"]["dense"]["kernel"],
                                fresh["block_1"]["moe"]["router"]["dense"]["kernel"])
  np.testing.assert_array_equal(out["block_0"]["mlp"]["fc1"]["kernel"],
                                dense_ckpt["block_0"]["mlp"]["fc1"]["kernel"])
  np.testing.assert_array_equal(out["block_1"]["attention"]["qkv_kernel"],
                                dense_ckpt["block_1"]["attention"]["qkv_kernel"])
  assert "mlp" not in out["block_1"]


def test_dense_mlp_into_moe_without_the_flag_suggests_it(dense_ckpt):
  fresh = random_tree(VMOE, 5, (8, 8, 3), seed=6)
  with pytest.raises(CheckpointError) as e:
    adapt_params(dense_ckpt, fresh, reinit_head=True)
  message = str(e.value)
  assert "dense MLP" in message
  assert "init.dense_to_experts=true" in message
  # 4 expert params + the router kernel missing, 4 dense MLP params of block_1 unused.
  assert _count(message) == 9
  assert "block_1/moe/experts/" in message and "block_1/mlp/" in message


def test_shape_mismatch_names_the_parameter_and_both_shapes(dense_ckpt):
  fresh = random_tree(dict(BASE, mlp_dim=12), 10, (8, 8, 3), seed=7)
  with pytest.raises(CheckpointError) as e:
    adapt_params(dense_ckpt, fresh, reinit_head=True)
  message = str(e.value)
  # fc1 kernel and bias, fc2 kernel, in each of the two blocks.
  assert _count(message) == 6
  problem = _problem(message, "block_0/mlp/fc1/kernel")
  assert re.search(r"\(8, 16\).*\(8, 12\)", problem), problem
  problem = _problem(message, "block_1/mlp/fc2/kernel")
  assert re.search(r"\(16, 8\).*\(12, 8\)", problem), problem
  problem = _problem(message, "block_1/mlp/fc1/bias")
  assert re.search(r"\(16,\).*\(12,\)", problem), problem


def test_extra_and_missing_checkpoint_params_are_reported(dense_ckpt):
  fresh = random_tree(BASE, 10, (8, 8, 3), seed=9)
  extra = jax.tree.map(np.copy, dense_ckpt)
  extra["block_0"]["extra"] = {"w": np.zeros((2,), np.float32)}
  with pytest.raises(CheckpointError) as e:
    adapt_params(extra, fresh, reinit_head=True, source="checkpoint X")
  message = str(e.value)
  assert _count(message) == 1
  assert "checkpoint X" in message
  assert re.search(r"not in the model", _problem(message, "block_0/extra/w"))
  missing = jax.tree.map(np.copy, dense_ckpt)
  del missing["block_1"]["norm1"]["scale"]
  with pytest.raises(CheckpointError) as e:
    adapt_params(missing, fresh, reinit_head=True)
  assert _count(str(e.value)) == 1
  assert "missing" in _problem(str(e.value), "block_1/norm1/scale")


def test_many_problems_are_truncated_with_a_count(dense_ckpt):
  fresh = random_tree(dict(BASE, hidden_size=6, num_heads=2), 10, (8, 8, 3), seed=11)
  with pytest.raises(CheckpointError) as e:
    adapt_params(dense_ckpt, fresh, reinit_head=True)
  message = str(e.value)
  total = _count(message)
  assert total > 12
  more = int(re.search(r"and (\d+) more", message)[1])
  shown = len(re.findall(r"[\w/]+: (?:checkpoint|missing|in the)", message))
  assert 0 < shown < total and shown + more == total


@pytest.mark.parametrize("router", [dict(type="experts_choice"), dict(type="soft")])
def test_a_new_router_family_starts_fresh_and_keeps_the_experts(router):
  """Token-choice V-MoE -> experts-choice or Soft MoE: the router is new (the checkpoint's
  kernel is left out, even when it has the same shape), the experts and the rest are copied;
  a pooled model leaves the class token behind."""
  token_choice = random_tree(VMOE, 5, (8, 8, 3), seed=7)
  config = dict(VMOE, router=router, classifier="gap")
  fresh = random_tree(config, 5, (8, 8, 3), seed=8)
  out = flatten(adapt_params(token_choice, fresh, reinit_head=True, new_router=True))
  old, new = flatten(token_choice), flatten(fresh)
  assert out.keys() == new.keys() and "cls" not in out
  for name, value in out.items():
    want = new[name] if name.startswith(("head/", "block_1/moe/router/")) else old[name]
    np.testing.assert_array_equal(value, want, err_msg=name)
  assert any("/moe/router/" in n for n in out)
  # Without new_router the token-choice kernel would be taken (experts-choice: same shape) or
  # reported as left over (Soft MoE).
  if router["type"] == "experts_choice":
    kept = flatten(adapt_params(token_choice, fresh, reinit_head=True))
    np.testing.assert_array_equal(kept["block_1/moe/router/dense/kernel"],
                                  old["block_1/moe/router/dense/kernel"])
  else:
    with pytest.raises(CheckpointError, match="router/dense/kernel: in the checkpoint"):
      adapt_params(token_choice, fresh, reinit_head=True)
