"""VisionTransformer / V-MoE: output shapes, parameter counts against the V-MoE paper (Table 7),
and the MoE layer against a dense MLP when every expert is that MLP.

Shapes and counts use jax.eval_shape (no compilation, no allocation); only the MoE-vs-dense check
runs real computation (two small jit compilations).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.models import build_model, model_config
from runner.models.moe.layer import MoeMlpBlock
from runner.models.vit import MlpBlock, VisionTransformer
from runner.models.size import count_params
from runner.train.state import abstract_params

TINY = dict(num_classes=7, patch_size=4, hidden_size=16, num_layers=2, mlp_dim=32, num_heads=2)


def _forward_shapes(model, batch=3, image=(8, 8, 3), train=False):
  params, _ = abstract_params(model, image)
  images = jax.ShapeDtypeStruct((batch,) + image, jnp.float32)
  return params, jax.eval_shape(
      lambda p, x: model.apply({"params": p}, x, train=train,
                               rngs={"gating": jax.random.key(0), "dropout": jax.random.key(0)}),
      params, images)


@pytest.mark.parametrize("classifier", ["token", "gap", "map"])
@pytest.mark.parametrize("representation_size", [None, 24])
def test_forward_shapes(classifier, representation_size):
  model = VisionTransformer(**TINY, classifier=classifier, representation_size=representation_size)
  params, (logits, extras) = _forward_shapes(model)
  assert logits.shape == (3, 7) and logits.dtype == jnp.float32
  assert extras["pre_logits"].shape == (3, representation_size or 16)
  assert extras["routing"] == {}
  assert extras["auxiliary_loss"].shape == ()
  # Parameters of each classifier: cls token only for "token", a probe + attention for "map".
  assert ("cls" in params) == (classifier == "token")
  assert ("map_head" in params) == (classifier == "map")
  assert ("pre_logits" in params) == bool(representation_size)
  assert params["head"]["kernel"].shape == (representation_size or 16, 7)
  # 8x8 images in 4x4 patches: 4 tokens, position embeddings exclude the class token.
  assert params["pos_embedding"].shape == (1, 4, 16)


def test_vmoe_forward_shapes_and_routing_extras():
  model = VisionTransformer(**TINY, moe_layers=(1,), moe=dict(
      num_experts=4, group_size=2, router=dict(k=2)))
  params, (logits, extras) = _forward_shapes(model, batch=4, train=True)
  assert logits.shape == (4, 7)
  assert set(extras["routing"]) == {"layer_1"}
  metrics = extras["routing"]["layer_1"]
  assert {"importance_loss", "load_loss", "auxiliary_loss", "fraction_dropped_tokens",
          "expert_load"} <= set(metrics)
  assert metrics["expert_load"].shape == (4,)
  assert "mlp" in params["block_0"] and "moe" not in params["block_0"]
  assert "moe" in params["block_1"] and "mlp" not in params["block_1"]
  experts = params["block_1"]["moe"]["experts"]
  assert experts["fc1_kernel"].shape == (4, 16, 32)
  assert experts["fc2_kernel"].shape == (4, 32, 16)
  assert params["block_1"]["moe"]["router"]["dense"]["kernel"].shape == (16, 4)


def test_image_not_divisible_by_patch_raises():
  model = VisionTransformer(**TINY)
  with pytest.raises(ValueError, match="not divisible by patch size"):
    abstract_params(model, (10, 10, 3))


# Table 7 of the V-MoE paper ("Params" column). The paper's models are JFT-300M models: their head
# has 18,291 classes and, as in ViT upstream training, a pre-logits (representation) layer of the
# hidden size. With exactly that head, the counts agree to the table's 0.1M rounding; without the
# pre-logits layer ViT-S/32 would count 36.2M, so the comparison is sensitive to it.
JFT_CLASSES = 18_291
TABLE_7_PARAMS_M = {
    "vit_s32": 36.5,
    "vit_b32": 102.1,
    "vit_b16": 100.5,
    "vmoe_s32_last2": 166.7,
    "vmoe_s32_every2": 296.9,
    "vmoe_b16_every2": 979.0,
    "vmoe_h14_last5": 2688.6,
}


@pytest.mark.parametrize("name", sorted(TABLE_7_PARAMS_M))
def test_parameter_counts_match_table_7(name):
  config = model_config(name)
  config = dataclasses.replace(config, representation_size=config.hidden_size)
  params, _ = abstract_params(build_model(config, JFT_CLASSES), (224, 224, 3))
  assert round(count_params(params) / 1e6, 1) == TABLE_7_PARAMS_M[name]


def test_parameter_count_of_the_body_by_hand():
  """ViT-S/32 without head, counted from the architecture by hand (independent of the table)."""
  d, mlp, layers, p, tokens = 512, 2048, 8, 32, 49
  block = (2 * 2 * d                # two LayerNorms
           + d * 3 * d + 3 * d      # fused qkv
           + d * d + d              # attention output
           + d * mlp + mlp + mlp * d + d)  # MLP
  body = p * p * 3 * d + d + tokens * d + d + layers * block + 2 * d  # + cls + encoder norm
  params, _ = abstract_params(build_model(model_config("vit_s32"), 10), (224, 224, 3))
  assert count_params(params) == body + d * 10 + 10
  # Each V-MoE layer replaces one MLP by E copies plus a router (d x E, no bias).
  vmoe, _ = abstract_params(build_model(model_config("vmoe_s32_last2"), 10), (224, 224, 3))
  mlp_params = d * mlp + mlp + mlp * d + d
  assert count_params(vmoe) == count_params(params) + 2 * (31 * mlp_params + d * 32)


# -- MoE layer whose experts are all the same dense MLP ---------------------------------------


def _routing_reference(x, router_kernel, k, capacity, group_size):
  """NumPy top-k routing without batch priority: all first choices (in token order) before any
  second choice; an assignment is kept while its expert has buffer room. Returns, per token, the
  sum of the gates of its kept assignments, and the fraction of tokens with no kept assignment."""
  b, t, d = x.shape
  groups = x.reshape(b // group_size, group_size * t, d).astype(np.float64)
  logits = groups @ router_kernel
  gates = np.exp(logits - logits.max(-1, keepdims=True))
  gates /= gates.sum(-1, keepdims=True)
  order = np.argsort(-gates, axis=-1, kind="stable")[..., :k]
  total = np.zeros(groups.shape[:2])
  kept_any = np.zeros(groups.shape[:2], bool)
  for g in range(groups.shape[0]):
    fill = np.zeros(router_kernel.shape[1], int)
    for choice in range(k):
      for s in range(groups.shape[1]):
        e = order[g, s, choice]
        if fill[e] < capacity:
          fill[e] += 1
          total[g, s] += gates[g, s, e]
          kept_any[g, s] = True
  return total.reshape(b, t), 1.0 - kept_any.mean()


# Groups of 2 images x 6 tokens = 12 tokens; capacity round(k * 12 * ratio / E) with k=2, E=4.
@pytest.mark.parametrize("capacity_ratio,capacity", [(0.5, 3), (4.0, 24)])
def test_moe_with_identical_experts_is_gate_weighted_dense_mlp(capacity_ratio, capacity):
  b, t, d, mlp, e, k, group = 4, 6, 16, 32, 4, 2, 2
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  dense = MlpBlock(mlp_dim=mlp)
  moe = MoeMlpBlock(num_experts=e, mlp_dim=mlp, group_size=group,
                    router=dict(k=k, capacity_ratio=capacity_ratio))
  dense_params = {"fc1": {"kernel": rng.normal(size=(d, mlp)) * 0.3, "bias": rng.normal(size=mlp)},
                  "fc2": {"kernel": rng.normal(size=(mlp, d)) * 0.3, "bias": rng.normal(size=d)}}
  dense_params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), dense_params)
  router_kernel = rng.normal(size=(d, e)).astype(np.float32)
  tile = lambda a: jnp.broadcast_to(a, (e,) + a.shape)
  moe_params = {"router": {"dense": {"kernel": jnp.asarray(router_kernel)}},
                "experts": {"fc1_kernel": tile(dense_params["fc1"]["kernel"]),
                            "fc1_bias": tile(dense_params["fc1"]["bias"]),
                            "fc2_kernel": tile(dense_params["fc2"]["kernel"]),
                            "fc2_bias": tile(dense_params["fc2"]["bias"])}}
  # The hand-built tree has exactly the module's parameter shapes.
  abstract = nn.meta.unbox(
      jax.eval_shape(lambda: moe.init(jax.random.key(0), x, train=False))["params"])
  shape_of = lambda tree: jax.tree.map(lambda a: tuple(a.shape), tree)
  assert shape_of(moe_params) == shape_of(abstract)

  y_dense = jax.jit(lambda p, x: dense.apply({"params": p}, x, train=False))(dense_params, x)
  y_moe, metrics = jax.jit(lambda p, x: moe.apply({"params": p}, x, train=False))(moe_params, x)
  weight, dropped = _routing_reference(np.asarray(x), router_kernel.astype(np.float64), k,
                                       capacity, group)
  np.testing.assert_allclose(np.asarray(y_moe), weight[..., None] * np.asarray(y_dense),
                             rtol=1e-4, atol=1e-5)
  assert float(metrics["fraction_dropped_tokens"]) == pytest.approx(dropped, abs=1e-6)
  if capacity_ratio < 1:
    # The setting is non-trivial: some tokens lost every assignment, some kept both.
    assert (weight == 0).any() and dropped > 0
    assert (weight > 0).any()
  else:
    # Ample capacity: every token keeps both choices, weight = sum of its top-2 gates.
    assert dropped == 0 and (weight > 0).all()
