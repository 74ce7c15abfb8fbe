"""Expert compression (runner/models/compression.py) and its calibration pass
(runner/models/expert_statistics.py) against references written from the papers' definitions:
HC-SMoE's clustering (Chen et al. 2024: average linkage on Euclidean distances between the
experts' average outputs) against SciPy's UPGMA, per partition of a batch ensemble; its merge
(the frequency-weighted average of a cluster's parameters, router columns included) and the
frequency pruning baseline against NumPy loops; Lu et al.'s pruning (every subset's output error)
against a NumPy V-MoE layer written from the V-MoE paper's Algorithm 1; and the calibration
statistics of a tiny V-MoE against its own routing records and every expert's MLP applied, in
NumPy, to the layer's input."""
from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import moe_reference
import numpy as np
import pytest
from scipy.cluster import hierarchy

from runner.models import build_model, compression, introspection, model_config
from runner.models import expert_statistics
from runner.tasks.compress import compressed_model

E, D, H = 8, 6, 10


def _scipy_groups(points, clusters: int) -> set[frozenset]:
  """UPGMA: SciPy's average linkage on Euclidean distances, cut into `clusters` groups."""
  labels = hierarchy.fcluster(hierarchy.linkage(points, method="average", metric="euclidean"),
                              t=clusters, criterion="maxclust")
  return {frozenset(np.flatnonzero(labels == label).tolist()) for label in set(labels)}


@pytest.mark.parametrize("experts", [4, 8, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_average_linkage_is_scipys_upgma(experts, seed):
  points = np.random.default_rng(seed).normal(size=(experts, 5))
  for clusters in range(1, experts + 1):
    got = compression.average_linkage(points, clusters)
    assert {frozenset(g) for g in got} == _scipy_groups(points, clusters), clusters
    assert sorted(e for g in got for e in g) == list(range(experts))


def test_average_linkage_finds_two_obvious_blobs():
  rng = np.random.default_rng(0)
  points = np.zeros((6, 3))
  points[[0, 2, 5]] = 10 + 0.01 * rng.normal(size=(3, 3))
  points[[1, 3, 4]] = -10 + 0.01 * rng.normal(size=(3, 3))
  assert compression.average_linkage(points, 2) == [[0, 2, 5], [1, 3, 4]]


@pytest.mark.parametrize("keep, partitions", [(4, 2), (2, 2), (8, 4), (4, 4)])
def test_merge_plan_clusters_each_partition_on_its_own(keep, partitions):
  """Partition p's experts lie next to partition 0's, so clustering across partitions would pair
  expert e with e + E/M."""
  rng = np.random.default_rng(keep + partitions)
  size = 16 // partitions
  base = rng.normal(size=(size, 4))
  outputs = np.concatenate([base + 1e-3 * rng.normal(size=base.shape) for _ in range(partitions)])
  plan = compression.merge_plan(outputs, keep, partitions)
  assert len(plan) == keep
  for p in range(partitions):
    ids = set(range(p * size, (p + 1) * size))
    mine = [g for g in plan if set(g) & ids]
    assert all(set(g) <= ids for g in mine)
    assert len(mine) == keep // partitions
    want = {frozenset(p * size + e for e in g)
            for g in _scipy_groups(outputs[p * size:(p + 1) * size], keep // partitions)}
    assert {frozenset(g) for g in mine} == want


def _prune_reference(counts, weights, keep, partitions):
  """Per partition, the keep/M experts first by (most chosen, largest summed weight, lowest id)."""
  size, plan = len(counts) // partitions, []
  for p in range(partitions):
    ids = np.arange(p * size, (p + 1) * size)
    order = np.lexsort((ids, -weights[ids], -counts[ids]))  # the last key sorts first
    plan += [[int(e)] for e in np.sort(ids[order[:keep // partitions]])]
  return plan


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("keep, partitions", [(3, 1), (5, 1), (4, 2), (4, 4)])
def test_prune_keeps_the_most_chosen_experts(seed, keep, partitions):
  rng = np.random.default_rng(seed)
  counts = rng.integers(0, 4, size=E).astype(np.float64)  # ties are common
  weights = rng.integers(1, 3, size=E).astype(np.float64)  # and ties of weight too
  want = _prune_reference(counts, weights, keep, partitions)
  assert compression.prune_plan(counts, weights, keep, partitions) == want


def test_prune_with_experts_choice_counts_keeps_the_heaviest():
  """Experts-choice: every expert takes as many tokens, so the summed weights decide; where they
  tie too, the lower id."""
  counts = np.full(E, 12.0)
  weights = np.array([0.5, 3.0, 1.0, 2.0, 0.1, 2.5, 0.7, 0.2])
  assert compression.prune_plan(counts, weights, 3) == [[1], [3], [5]]
  assert compression.prune_plan(counts, weights, 4, partitions=2) == [[1], [3], [5], [6]]
  assert compression.prune_plan(counts, np.ones(E), 3) == [[0], [1], [2]]


def _layer(seed=0):
  rng = np.random.default_rng(seed)
  experts = {"fc1_kernel": rng.normal(size=(E, D, H)), "fc1_bias": rng.normal(size=(E, H)),
             "fc2_kernel": rng.normal(size=(E, H, D)), "fc2_bias": rng.normal(size=(E, D))}
  router = {"dense/kernel": rng.normal(size=(D, E)), "balance_bias": rng.normal(size=(E,))}
  return ({k: v.astype(np.float32) for k, v in experts.items()},
          {k: v.astype(np.float32) for k, v in router.items()})


def test_apply_plan_is_the_frequency_weighted_average():
  experts, router = _layer()
  counts = np.array([3.0, 1.0, 0.0, 0.0, 6.0, 2.0, 5.0, 7.0])
  plan = [[0, 1, 5], [2, 3], [4], [6, 7]]  # [2, 3]: never chosen, a plain mean
  new_experts, new_router = compression.apply_plan(experts, router, plan, counts)
  for j, group in enumerate(plan):
    f = counts[group] if counts[group].sum() > 0 else np.ones(len(group))
    for name, value in experts.items():
      want = sum(f_i * value[i].astype(np.float64) for f_i, i in zip(f, group)) / f.sum()
      np.testing.assert_allclose(new_experts[name][j], want, rtol=1e-6, atol=1e-6, err_msg=name)
    for name, value in router.items():
      want = sum(f_i * value[..., i].astype(np.float64) for f_i, i in zip(f, group)) / f.sum()
      np.testing.assert_allclose(new_router[name][..., j], want, rtol=1e-6, atol=1e-6,
                                 err_msg=name)
  assert new_experts["fc1_kernel"].shape == (len(plan), D, H)
  assert new_router["dense/kernel"].shape == (D, len(plan))


def test_merging_identical_experts_keeps_their_function():
  """Experts 2 and 5 copies of one another (router columns too): merged with any frequencies,
  the new expert is the same MLP, and its router logit the same."""
  experts, router = _layer(1)
  for params in (*experts.values(), router["balance_bias"]):
    params[5] = params[2]
  router["dense/kernel"][:, 5] = router["dense/kernel"][:, 2]
  plan = [[0, 1], [2, 5], [3, 4, 6, 7]]
  new, new_router = compression.apply_plan(experts, router, plan, np.arange(1.0, E + 1))

  def mlp(p, e, x):
    h = jax.nn.gelu(x @ p["fc1_kernel"][e] + p["fc1_bias"][e], approximate=True)
    return h @ p["fc2_kernel"][e] + p["fc2_bias"][e]

  x = jnp.asarray(np.random.default_rng(2).normal(size=(20, D)), jnp.float32)
  for e in (2, 5):
    np.testing.assert_allclose(mlp(new, 1, x), mlp(experts, e, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x @ new_router["dense/kernel"][:, 1],
                               x @ router["dense/kernel"][:, e], rtol=1e-5, atol=1e-5)


# gather: a tiny V-MoE with MoE MLPs on both blocks, routing groups of 2 images; batches of 4.
CLASSES, B = 3, 4


@pytest.fixture(scope="module")
def vmoe():
  config = dataclasses.replace(model_config("vmoe_tiny"), num_layers=2, hidden_size=32,
                               mlp_dim=64, num_heads=2, image_size=16, patch_size=4)
  config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, layers=[0, 1],
                                                                group_size=2))
  model = build_model(config, CLASSES)
  keys = {"params": jax.random.key(0), "gating": jax.random.key(1)}
  params = nn.meta.unbox(model.init(keys, jnp.zeros((2, 16, 16, 3)), train=False)["params"])
  images = np.random.default_rng(0).normal(size=(3 * B, 16, 16, 3)).astype(np.float32)
  return model, params, images


def _batches(images, real: int):
  """Batches of B of `images`, the last one's images from `real` on padding."""
  for start in range(0, len(images), B):
    mask = np.arange(start, start + B) < real
    yield {"image": images[start:start + B], "_mask": mask,
           "labels": np.eye(CLASSES, dtype=np.float32)[np.arange(B) % CLASSES]}


def _reference(model, params, images):
  """Per layer: (summed expert_mask, summed expert_weights, summed routed_mask) of the routing
  records, and each expert's MLP (NumPy, float64) applied to every token of the layer's input
  (block i's norm2 output), averaged over the images and tokens."""
  _, _, records = jax.jit(lambda p, x: introspection.apply_with_routing(
      model, p, x, train=False))(params, images)
  _, state = jax.jit(lambda p, x: model.apply(
      {"params": p}, x, train=False, mutable=["intermediates"],
      capture_intermediates=lambda module, _: module.name == "norm2"))(params, images)
  out = {}
  for layer, r in records.items():
    block = f"block_{layer.split('_')[-1]}"
    x = np.asarray(state["intermediates"][block]["norm2"]["__call__"][0], np.float64)
    x = x.reshape(-1, x.shape[-1])
    p = {k: np.asarray(v, np.float64) for k, v in params[block]["moe"]["experts"].items()}
    means = []
    for e in range(len(p["fc1_bias"])):
      z = x @ p["fc1_kernel"][e] + p["fc1_bias"][e]
      h = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
      means.append((h @ p["fc2_kernel"][e] + p["fc2_bias"][e]).mean(0))
    out[layer] = tuple(np.asarray(r[k], np.float64).sum((0, 1))
                       for k in ("expert_mask", "expert_weights", "routed_mask")) + (
                           np.stack(means), x.shape[0])
  return out


def _check(stats, want):
  assert sorted(stats) == sorted(want) == ["layer_0", "layer_1"]
  for layer, (chosen, weights, routed, means, tokens) in want.items():
    s = stats[layer]
    np.testing.assert_array_equal(s.chosen, chosen, err_msg=layer)
    np.testing.assert_array_equal(s.routed, routed, err_msg=layer)
    np.testing.assert_allclose(s.weights, weights, rtol=1e-5, err_msg=layer)
    np.testing.assert_allclose(s.mean_outputs, means, rtol=1e-4, atol=1e-6, err_msg=layer)
    assert s.tokens == tokens


def test_gather_counts_real_images_only(vmoe):
  """10 real images, the last batch's other 2 padding: the statistics are those of the 10 alone
  (their routing groups are the same: 2 consecutive images), whatever the padding holds."""
  model, params, images = vmoe
  kwargs = dict(examples=100, partitions=1, tiled=False, outputs=True)
  stats, seen = expert_statistics.gather(model, params, _batches(images, 10), **kwargs)
  assert seen == 10
  _check(stats, _reference(model, params, images[:10]))
  other = images.copy()
  other[10:] = 50 * np.random.default_rng(1).normal(size=other[10:].shape)
  again, _ = expert_statistics.gather(model, params, _batches(other, 10), **kwargs)
  for layer, s in stats.items():
    for name in ("chosen", "routed", "weights", "mean_outputs", "tokens"):
      np.testing.assert_array_equal(getattr(again[layer], name), getattr(s, name), err_msg=name)


def test_gather_stops_at_examples(vmoe):
  """examples=6: the first batch, and the first 2 images of the second."""
  model, params, images = vmoe
  stats, seen = expert_statistics.gather(model, params, _batches(images, 12), examples=6,
                                   partitions=1, tiled=False, outputs=True)
  assert seen == 6
  _check(stats, _reference(model, params, images[:6]))


def _layer_reference(x, experts, kernel, *, k: int, group: int, capacity_ratio: float):
  """A V-MoE layer in NumPy (float64), from the paper: a softmax over the experts, then
  Algorithm 1's buffers of round(k * S * C / E) slots per routing group of S tokens
  (moe_reference.route_reference), each token's output the weighted sum of the experts that took
  it. x: (tokens, D), groups of `group` consecutive tokens."""
  num = kernel.shape[1]
  capacity = max(1, math.floor(k * group * capacity_ratio / num + 0.5))
  out = np.zeros_like(x)
  for start in range(0, len(x), group):
    xs = x[start:start + group]
    gates = np.exp(xs @ kernel - (xs @ kernel).max(-1, keepdims=True))
    gates /= gates.sum(-1, keepdims=True)
    for e, buffer in enumerate(moe_reference.route_reference(gates, k, capacity)):
      for p, _, w in buffer:
        z = xs[p] @ experts["fc1_kernel"][e] + experts["fc1_bias"][e]
        h = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
        out[start + p] += w * (h @ experts["fc2_kernel"][e] + experts["fc2_bias"][e])
  return out


def test_prune_measures_each_subset_as_lu_et_al(vmoe):
  """Lu et al.'s expert pruning: of the C(8, 4) ways to keep 4 experts, the one whose layer
  output is nearest (squared Frobenius distance over the calibration tokens) the layer's with
  all 8. Every subset's relative error against the NumPy layer above, so the argmin too."""
  model, params, images = vmoe
  stats, _ = expert_statistics.gather(model, params, _batches(images[:8], 8), examples=8, partitions=1,
                                tiled=False, outputs=False, keep_io=True)
  config = dataclasses.replace(model_config("vmoe_tiny"), num_layers=2, hidden_size=32,
                               mlp_dim=64, num_heads=2, image_size=16, patch_size=4)
  config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, layers=[0, 1],
                                                                group_size=2, num_experts=4))
  small = build_model(config, CLASSES)
  block = {"mlp_dim": small.mlp_dim, **small.moe, "dtype": small.dtype}
  moe = params["block_1"]["moe"]
  subsets = list(compression.subsets(E, 4))
  assert len(subsets) == math.comb(E, 4) and subsets[0] == [0, 1, 2, 3]
  candidates = []
  for kept in subsets:
    experts, router = compression.apply_plan(moe["experts"], {"kernel": moe["router"]["dense"]
                                                              ["kernel"]}, [[e] for e in kept],
                                             np.ones(E))
    candidates.append({**moe, "experts": experts, "router": {"dense": router}})
  errors = expert_statistics.reconstruction_errors(block, stats["layer_1"].io, candidates)
  x = np.concatenate([np.asarray(x, np.float64).reshape(-1, 32) for x, _, _ in stats["layer_1"].io])
  experts = {n: np.asarray(v, np.float64) for n, v in moe["experts"].items()}
  kernel = np.asarray(moe["router"]["dense"]["kernel"], np.float64)
  layer = dict(k=2, group=2 * 17, capacity_ratio=config.router.capacity_ratio)
  whole = _layer_reference(x, experts, kernel, **layer)
  captured = np.concatenate([np.asarray(y).reshape(-1, 32) for _, y, _ in stats["layer_1"].io])
  np.testing.assert_allclose(captured, whole, rtol=1e-4, atol=1e-5)  # the reference is the layer
  want = [((_layer_reference(x, {n: v[kept] for n, v in experts.items()}, kernel[:, kept],
                             **layer) - whole) ** 2).sum() / (whole ** 2).sum() for kept in subsets]
  np.testing.assert_allclose(errors, want, rtol=1e-4)
  assert int(np.argmin(errors)) == int(np.argmin(want))


@pytest.mark.parametrize("variant", ["pbe", "tiling_only", "partition_only"])
def test_gather_follows_each_ensemble_layout(vmoe, variant):
  """A batch ensemble of M=2 (E=8, k=1), laid out as `vmoe compress` calls gather: `chosen`
  against the summed expert_mask records (a tiled row's M copies side by side on the tokens
  axis), and expert e's mean output against its MLP (NumPy, float64) over the rows its partition
  sees: pbe member e // (E/M)'s copies (row b*M + m) only, tiling_only (one router over all E)
  every copy, partition_only every (untiled) row. Padding changes nothing."""
  _, _, images = vmoe
  m = 2
  config = dataclasses.replace(model_config("vmoe_tiny"), num_layers=2, hidden_size=32,
                               mlp_dim=64, num_heads=2, image_size=16, patch_size=4)
  config = dataclasses.replace(config, router=dataclasses.replace(config.router, k=1),
                               moe=dataclasses.replace(config.moe, layers=[0, 1], group_size=2,
                                                       ensemble_size=m, ensemble_variant=variant))
  model = build_model(config, CLASSES)
  keys = {"params": jax.random.key(0), "gating": jax.random.key(1)}
  params = nn.meta.unbox(model.init(keys, jnp.zeros((2, 16, 16, 3)), train=False)["params"])
  tiled = variant != "partition_only"
  kwargs = dict(examples=100, partitions=1 if variant == "tiling_only" else m, tiled=tiled,
                outputs=True)
  stats, seen = expert_statistics.gather(model, params, _batches(images, 10), **kwargs)
  _, _, records = jax.jit(lambda p, x: introspection.apply_with_routing(
      model, p, x, train=False))(params, images[:10])
  _, state = jax.jit(lambda p, x: model.apply(
      {"params": p}, x, train=False, mutable=["intermediates"],
      capture_intermediates=lambda module, _: module.name == "norm2"))(params, images[:10])
  assert seen == 10 and sorted(stats) == sorted(records) == ["layer_0", "layer_1"]
  for layer, r in records.items():
    block = f"block_{layer.split('_')[-1]}"
    x = np.asarray(state["intermediates"][block]["norm2"]["__call__"][0], np.float64)
    assert x.shape[0] == (10 * m if tiled else 10)
    p = {k: np.asarray(v, np.float64) for k, v in params[block]["moe"]["experts"].items()}
    assert len(p["fc1_bias"]) == E
    means = []
    for e in range(E):
      rows = x.reshape(10, m, *x.shape[1:])[:, e // (E // m)] if variant == "pbe" else x
      z = rows.reshape(-1, x.shape[-1]) @ p["fc1_kernel"][e] + p["fc1_bias"][e]
      h = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
      means.append((h @ p["fc2_kernel"][e] + p["fc2_bias"][e]).mean(0))
    s = stats[layer]
    np.testing.assert_array_equal(s.chosen, np.asarray(r["expert_mask"], np.float64).sum((0, 1)),
                                  err_msg=layer)
    np.testing.assert_allclose(s.mean_outputs, np.stack(means), rtol=1e-4, atol=1e-6,
                               err_msg=layer)
    assert s.tokens == x.shape[0] * x.shape[1]
  other = images.copy()
  other[10:] = 50 * np.random.default_rng(1).normal(size=other[10:].shape)
  again, _ = expert_statistics.gather(model, params, _batches(other, 10), **kwargs)
  for layer, s in stats.items():
    for name in ("chosen", "mean_outputs", "tokens"):
      np.testing.assert_array_equal(getattr(again[layer], name), getattr(s, name), err_msg=name)


@pytest.mark.parametrize("name, kept, k, experts", [
    ("vmoe_tiny", 2, 2, 2),  # k = 2 of 2 experts still fits
    ("vmoe_tiny_k2_m2", 2, 1, 2),  # each of 2 members keeps 1 expert: k = 1
    ("vmoe_tiny_k2_f2", 2, 1, 1),  # 2 routed experts of a split of 2: k * 2 <= 2
    ("vmoe_tiny_k1_f2", 4, 1, 2)])
def test_compressed_model_fits_k_to_what_a_router_keeps(name, kept, k, experts):
  model = compressed_model(model_config(name), kept)
  assert (model.router.k, model.moe.num_experts) == (k, experts)
