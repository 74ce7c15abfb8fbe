"""runner.checkpoints.mapping: released checkpoints' names onto our model, with logits parity.

Random parameter trees under the reference names of google-research/vmoe (V-MoE, E³,
experts-choice, Soft MoE, query/key-normalised ViTs), big_vision and vision_transformer are mapped
with `to_ours`, loaded into our model and run; the logits must match a NumPy re-implementation of
the reference forward pass (tests/formats/reference_vit.py, float64) to 1e-5. Token-choice
capacities are large enough that no token is dropped, as that reference assumes; experts-choice
capacities are the reference's `compute_capacity` for the rounding our config names. The
experts-choice and Soft MoE trees go through the whole released-checkpoint path: written in
google-research/vmoe's format (tests/formats/vmoe_writer.py) and read back by `runner.checkpoints.weights`.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
from formats import reference_vit, vmoe_writer  # tests/ is on sys.path (conftest rootdir)
from formats.reference_tree import SUBLAYERS, reference_tree

from runner.checkpoints import mapping, weights
from runner.checkpoints.checkpoint import CheckpointError
from runner.models import build_model, model_config
from runner.models.moe import routers
from runner.models.transfer import flatten, unflatten
from runner.train.state import abstract_params

D, LAYERS, MLP, HEADS, PATCH, IMAGE, CLASSES = 32, 4, 64, 2, 4, 16, 10
TOKENS = (IMAGE // PATCH) ** 2
HEAD_DIM = D // HEADS
BATCH = 4
TOL = 1e-5

def our_model(*, moe_layers=(), experts=4, k=2, members=1, classifier="token", representation=None):
  base = model_config("vmoe_tiny" if moe_layers else "vit_tiny")
  config = dataclasses.replace(base, image_size=IMAGE, patch_size=PATCH, hidden_size=D,
                               num_layers=LAYERS, mlp_dim=MLP, num_heads=HEADS,
                               classifier=classifier, representation_size=representation)
  if moe_layers:
    config = dataclasses.replace(
        config, moe=dataclasses.replace(config.moe, layers=list(moe_layers), num_experts=experts,
                                        ensemble_size=members),
        # capacity = ratio * k * tokens / E: with ratio = E every token fits every expert.
        router=dataclasses.replace(config.router, k=k, capacity_ratio=float(experts)))
  return build_model(config, CLASSES)


def images(seed=1):
  return np.random.default_rng(seed).uniform(-1, 1, (BATCH, IMAGE, IMAGE, 3)).astype(np.float32)


def run_ours(model, ours: dict, x):
  """Our (logits, extras) with the mapped parameters, after checking they are exactly the
  model's parameter names and shapes."""
  fresh = flatten(abstract_params(model, (IMAGE, IMAGE, 3))[0])
  assert sorted(ours) == sorted(fresh)
  assert {n: v.shape for n, v in ours.items()} == {n: v.shape for n, v in fresh.items()}
  assert all(v.dtype == np.float32 for v in ours.values())
  return jax.jit(lambda p, x: model.apply({"params": p}, x, train=False))(unflatten(ours), x)


def reference(tree, layout, *, k=2, members=1):
  trace = {}
  logits = reference_vit.forward(tree, images(), layout=layout, k=k, ensemble_size=members,
                                 trace=trace)
  # A near tie between a token's k-th and (k+1)-th gate would make the experts it reaches
  # depend on rounding, not on the mapping; the seeds are chosen so that there is none.
  assert trace.get("min_gate_margin", 1.0) > 1e-5  # float32 gates are ~1e-7 off
  return logits


def test_vmoe_logits_match_the_reference():
  tree = reference_tree("vmoe", moe_layers=(1, 3))
  # As a train state: parameters under params/, beside optimizer state and a step.
  state = {f"params/{n}": v for n, v in tree.items()}
  state.update({"opt_state/mu/Encoder/encoder_norm/scale": np.zeros(D), "step": np.array(7)})
  ours = mapping.to_ours(state)
  logits, extras = run_ours(our_model(moe_layers=(1, 3), k=2), ours, images())
  want = reference(tree, "vmoe", k=2)
  diff = np.abs(np.asarray(logits) - want).max()
  print(f"V-MoE max |ours - reference| = {diff:.2e}")
  assert diff <= TOL
  assert np.abs(want).max() > 0.5  # logits of order one: the comparison is not of zeros
  assert float(extras["routing"]["layer_1"]["fraction_dropped_assignments"]) == 0.0


@pytest.mark.parametrize("router", ["stacked", "flat"])
def test_e3_member_logits_match_the_reference(router):
  tree = reference_tree("vmoe", seed=2, moe_layers=(1, 3), members=2, router=router)
  ours = mapping.to_ours(tree, ensemble_size=2)
  assert ours["block_1/moe/router/dense/kernel"].shape == (D, 4)
  logits, extras = run_ours(our_model(moe_layers=(1, 3), k=1, members=2), ours, images())
  want = reference(tree, "vmoe", k=1, members=2).reshape(BATCH, 2, CLASSES)  # rows b*M + m
  diff = np.abs(np.asarray(extras["member_logits"]) - want).max()
  print(f"E³ ({router} router) max |ours - reference| over members = {diff:.2e}")
  assert diff <= TOL
  assert np.abs(want[:, 0] - want[:, 1]).max() > 0.1  # the members differ: a real ensemble
  # The ensemble's prediction is the members' mean probability.
  probs = np.exp(want - want.max(-1, keepdims=True))
  mean = (probs / probs.sum(-1, keepdims=True)).mean(1)
  np.testing.assert_allclose(np.exp(np.asarray(logits)), mean, atol=1e-5)


def test_e3_router_as_stored_or_flat_map_to_the_same_kernel():
  stacked = mapping.to_ours(reference_tree("vmoe", moe_layers=(1, 3), members=2))
  flat = mapping.to_ours(reference_tree("vmoe", moe_layers=(1, 3), members=2, router="flat"))
  kernel = stacked["block_3/moe/router/dense/kernel"]
  np.testing.assert_array_equal(kernel, flat["block_3/moe/router/dense/kernel"])
  tree = reference_tree("vmoe", moe_layers=(1, 3), members=2)
  source = tree["Encoder/encoderblock_3/Moe/Router/dense/kernel"]  # (D, M, E/M)
  np.testing.assert_array_equal(kernel[:, 2:], source[:, 1])  # member 1: experts 2, 3


@pytest.mark.parametrize("layout,classifier,representation,scanned", [
    ("big_vision", "token", 16, False),
    ("big_vision", "map", None, True),
    ("vision_transformer", "token", None, False),
    ("vmoe", "gap", 24, False),
])
def test_vit_logits_match_the_reference(layout, classifier, representation, scanned):
  tree = reference_tree(layout, seed=3, classifier=classifier, representation=representation,
                        scanned=scanned)
  assert mapping.detect_layout(tree) == layout
  ours = mapping.to_ours(tree)
  logits, _ = run_ours(our_model(classifier=classifier, representation=representation), ours,
                       images())
  want = reference(tree, layout)
  diff = np.abs(np.asarray(logits) - want).max()
  print(f"ViT {layout} {classifier} rep={representation} scanned={scanned}: "
        f"max |ours - reference| = {diff:.2e}")
  assert diff <= TOL
  assert np.abs(want).max() > 0.5


@pytest.mark.parametrize("layout", ["vmoe", "vision_transformer"])
def test_class_position_fold_is_exact(layout):
  tree = reference_tree(layout, seed=4)
  posemb = tree[f"{SUBLAYERS[layout][0]}/posembed_input/pos_embedding"]
  ours = mapping.to_ours(tree)
  # The class token's input in the reference, cls + its position, computed as the reference does.
  np.testing.assert_array_equal(ours["cls"], tree["cls"] + posemb[:, :1])
  assert not np.array_equal(ours["cls"], tree["cls"])
  np.testing.assert_array_equal(ours["pos_embedding"], posemb[:, 1:])
  assert np.shares_memory(ours["pos_embedding"], posemb)  # a view, not a copy
  # Our patch tokens (embedding + our position rows) are the reference's patch tokens.
  model = our_model()
  x = images()
  seen = {}

  def record_embed(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == "embed":
      seen["patches"] = out
    return out

  with nn.intercept_methods(record_embed):
    model.apply({"params": unflatten(ours)}, x, train=False)
  patches = seen["patches"]
  want = reference_vit.conv_patches(x.astype(np.float64),
                                    tree["embedding/kernel"].astype(np.float64),
                                    tree["embedding/bias"]) + posemb[:, 1:]
  np.testing.assert_allclose(np.asarray(patches), want, atol=1e-5)


def test_big_vision_keeps_cls_and_posemb_as_they_are():
  tree = reference_tree("big_vision", seed=5)
  ours = mapping.to_ours({f"params/{n}": v for n, v in tree.items()})
  assert ours["cls"] is tree["cls"] or np.shares_memory(ours["cls"], tree["cls"])
  np.testing.assert_array_equal(ours["pos_embedding"], tree["pos_embedding"])


def test_q_k_v_are_stacked_in_our_order():
  tree = reference_tree("vision_transformer")
  ours = mapping.to_ours(tree)
  scope = "Transformer/encoderblock_2/MultiHeadDotProductAttention_1"
  for i, p in enumerate(("query", "key", "value")):
    np.testing.assert_array_equal(ours["block_2/attention/qkv_kernel"][:, i],
                                  tree[f"{scope}/{p}/kernel"])
    np.testing.assert_array_equal(ours["block_2/attention/qkv_bias"][i], tree[f"{scope}/{p}/bias"])


def test_detect_layout():
  assert mapping.detect_layout(reference_tree("vmoe", moe_layers=(1, 3))) == "vmoe"
  assert mapping.detect_layout(reference_tree("vision_transformer")) == "vision_transformer"
  bv = reference_tree("big_vision", scanned=True)
  assert mapping.detect_layout(bv) == "big_vision"
  state = {f"params/{n}": v for n, v in bv.items()} | {"opt/x": 0}
  assert mapping.detect_layout(state) == "big_vision"


def test_unknown_layout_is_an_error_naming_top_level_names_and_layouts():
  ours = {"block_0/norm1/scale": np.ones(D), "encoder_norm/scale": np.ones(D), "cls": np.ones(D)}
  with pytest.raises(CheckpointError, match=r"block_0.*cls.*encoder_norm.*Understood: .*vmoe"):
    mapping.detect_layout(ours)
  with pytest.raises(CheckpointError, match="big_vision"):
    mapping.to_ours(ours)
  with pytest.raises(CheckpointError, match="none"):
    mapping.detect_layout({"opt_state/mu": np.zeros(1)})


def test_misshaped_array_is_named():
  tree = reference_tree("vmoe", moe_layers=(1, 3))
  name = "Encoder/encoderblock_2/SelfAttention/key/kernel"
  tree[name] = np.zeros((D, HEADS, D // HEADS + 1), np.float32)
  tree["Encoder/encoderblock_3/Moe/Mlp/Dense_1/bias"] = np.zeros((4, D - 1), np.float32)
  with pytest.raises(CheckpointError) as e:
    mapping.to_ours(tree)
  message = str(e.value)
  assert f"{name}: shape (32, 2, 17), expected (32, 2, 16)" in message
  assert "Encoder/encoderblock_3/Moe/Mlp/Dense_1/bias: shape (4, 31), expected (4, 32)" in message
  assert "2 problem(s)" in message


def test_unmapped_and_missing_arrays_are_named_together():
  tree = reference_tree("big_vision", scanned=True)
  layer_scale = "LayerScale_0/scale"  # a layer our model does not have
  tree[f"Transformer/encoderblock/{layer_scale}"] = np.ones((LAYERS, D))
  tree["registers"] = np.zeros((1, 4, D), np.float32)
  del tree["Transformer/encoder_norm/bias"]
  with pytest.raises(CheckpointError) as e:
    mapping.to_ours(tree)
  message = str(e.value)
  assert "Transformer/encoder_norm/bias: missing" in message
  assert "registers: not mapped" in message
  assert f"Transformer/encoderblock_0/{layer_scale}: not mapped" in message
  assert f"{2 + LAYERS} problem(s)" in message and "more" not in message  # all six shown


def test_e3_ensemble_size_mismatch_is_an_error():
  tree = reference_tree("vmoe", moe_layers=(1, 3), members=2)
  with pytest.raises(CheckpointError, match=r"encoderblock_1/Moe/Router/dense/kernel.*M=2 members.*"
                                            r"ensemble_size=4"):
    mapping.to_ours(tree, ensemble_size=4)
  flat = reference_tree("vmoe", moe_layers=(1, 3), router="flat", experts=6, members=2)
  with pytest.raises(CheckpointError, match="6 experts cannot be split among ensemble_size=4"):
    mapping.to_ours(flat, ensemble_size=4)
  mapping.to_ours(tree, ensemble_size=2)
  mapping.to_ours(tree)  # not told: the stored (D, M, E/M) is read as (D, E)


def test_model_hint():
  hint = mapping.model_hint({f"params/{n}": v for n, v in
                             reference_tree("vmoe", moe_layers=(1, 3), members=2).items()})
  assert hint == {"layout": "vmoe", "hidden_size": D, "num_layers": LAYERS, "mlp_dim": MLP,
                  "num_heads": HEADS, "patch_size": PATCH, "image_size": IMAGE,
                  "classifier": "token", "representation_size": None, "num_classes": CLASSES,
                  "moe_layers": (1, 3), "num_experts": 4, "ensemble_size": 2,
                  "router": "token_choice or experts_choice", "slots_per_expert": None}
  hint = mapping.model_hint(reference_tree("big_vision", classifier="map", representation=16,
                                           scanned=True))
  assert (hint["layout"], hint["num_layers"], hint["classifier"], hint["representation_size"],
          hint["image_size"], hint["moe_layers"]) == ("big_vision", LAYERS, "map", 16, IMAGE, None)
  assert mapping.model_hint({"foo/bar": np.zeros(1)}) == {}


# --- Experts-choice and Soft MoE (vmoe/nn/routing.py NoisyTopItemsPerExpertRouter,
# vmoe/projects/soft_moe/router.py SoftRouter), with the Soft MoE paper's query/key norms.

def router_model(router, *, experts=4, group_size=1, capacity_ratio=1.0, rounding="paper",
                 slots=None, classifier="gap", qk_norm=True):
  """A catalog model of the router family (ecmoe_tiny / softmoe_tiny: GAP, one image per routing
  group, MoE on blocks 1 and 3) at the test's sizes."""
  base = model_config("softmoe_tiny" if router == "soft" else "ecmoe_tiny")
  assert base.router.type == router and base.moe.group_size == 1
  config = dataclasses.replace(
      base, image_size=IMAGE, patch_size=PATCH, hidden_size=D, num_layers=LAYERS, mlp_dim=MLP,
      num_heads=HEADS, classifier=classifier, attention_qk_norm=qk_norm,
      moe=dataclasses.replace(base.moe, num_experts=experts, group_size=group_size),
      router=dataclasses.replace(base.router, capacity_ratio=capacity_ratio,
                                 capacity_rounding=rounding, slots_per_expert=slots))
  return config, build_model(config, CLASSES)


def through_released_format(tmp_path, tree) -> dict:
  """`tree` written as a google-research/vmoe checkpoint and loaded as `init.checkpoint` is."""
  prefix = str(tmp_path / "released")
  vmoe_writer.write(prefix, tree, num_shards=3, chunks_per_array=2)
  params, config, step = weights.load(prefix)
  assert (config, step) == ({}, 0)
  return flatten(params)


@pytest.mark.parametrize("rounding,ratio,group_size,classifier,qk_norm,capacity", [
    # ecmoe_*: paper rounding is the soft_moe configs' ('round', multiple of 1) away from exact
    # halves: round(16 * 0.75 / 4) = 3 of an image's 16 tokens; some tokens reach no expert.
    ("paper", 0.75, 1, "gap", True, 3),
    # capacity_rounding=reference: routing.py's defaults ('ceil', multiple of 4); two images of
    # 16 patches + a class token per group: ceil(34 * 1.25 / 4) = 11 -> 12.
    ("reference", 1.25, 2, "token", False, 12),
])
def test_experts_choice_logits_match_the_reference(tmp_path, rounding, ratio, group_size,
                                                   classifier, qk_norm, capacity):
  tree = reference_tree("vmoe", seed=11, moe_layers=(1, 3), classifier=classifier,
                        qk_norm=qk_norm)  # experts-choice trees are token-choice trees
  ours = through_released_format(tmp_path, tree)
  config, model = router_model("experts_choice", group_size=group_size, capacity_ratio=ratio,
                               rounding=rounding, classifier=classifier, qk_norm=qk_norm)
  logits, extras = run_ours(model, ours, images())
  tokens = group_size * (TOKENS + (classifier == "token"))
  ceil_or_round, multiple_of = {"paper": ("round", 1), "reference": ("ceil", 4)}[rounding]
  trace = {}
  want = reference_vit.forward(tree, images(), layout="vmoe", router="experts_choice",
                               group_size=tokens, capacity_factor=ratio,
                               capacity_ceil_or_round=ceil_or_round,
                               capacity_multiple_of=multiple_of, trace=trace)
  assert trace["min_gate_margin"] > 1e-5  # no near tie between an expert's C-th and next gate
  assert trace["capacity"] == [capacity] * 2
  family = routers.family("experts_choice")
  assert family.capacity(config.router, tokens, 4, train=False) == capacity
  for layer, fraction in zip((1, 3), trace["fraction_processed_tokens"]):
    metrics = extras["routing"][f"layer_{layer}"]
    assert float(metrics["fraction_processed_tokens"]) == pytest.approx(fraction, abs=1e-6)
  if rounding == "paper":  # tokens that no expert picked pass through the residual alone
    assert min(trace["fraction_processed_tokens"]) < 1.0
  diff = np.abs(np.asarray(logits) - want).max()
  print(f"experts-choice ({rounding}, C={capacity}, {group_size} image(s) per group, "
        f"{classifier}, qk_norm={qk_norm}): max |ours - reference| = {diff:.2e}")
  assert diff <= TOL
  assert np.abs(want).max() > 0.5


@pytest.mark.parametrize("slots,config_slots,ratio,classifier", [
    (1, 1, 1.0, "gap"),  # softmoe_*: P = 1, slots_per_expert given
    # P derived from the capacity ratio: round(16 * 0.5 / 4) = 2; a MAP head, whose attention
    # the reference normalises too (MapHead(qk_norm=attention_qk_norm)).
    (2, None, 0.5, "map"),
])
def test_soft_moe_logits_match_the_reference(tmp_path, slots, config_slots, ratio, classifier):
  tree = reference_tree("vmoe", seed=12, moe_layers=(1, 3), router="soft", slots=slots,
                        qk_norm=True, classifier=classifier)
  ours = through_released_format(tmp_path, tree)
  assert ours["block_3/moe/router/mu"].shape == (D, 4, slots)
  config, model = router_model("soft", slots=config_slots, capacity_ratio=ratio,
                               classifier=classifier)
  assert routers.family("soft").slots(config.router, TOKENS, 4) == slots
  logits, _ = run_ours(model, ours, images())
  trace = {}
  want = reference_vit.forward(tree, images(), layout="vmoe", group_size=TOKENS, trace=trace)
  assert trace["slots"] == [slots] * 2
  diff = np.abs(np.asarray(logits) - want).max()
  print(f"Soft MoE (P={slots}, {classifier}, qk_norm): max |ours - reference| = {diff:.2e}")
  assert diff <= TOL
  assert np.abs(want).max() > 0.5


def test_soft_moe_and_qk_norm_names_map():
  tree = reference_tree("vmoe", moe_layers=(1, 3), router="soft", slots=2, qk_norm=True,
                        classifier="map")
  ours = mapping.to_ours(tree)
  for i in (1, 3):
    scope = f"Encoder/encoderblock_{i}/Moe/Router"
    assert ours[f"block_{i}/moe/router/mu"].shape == (D, 4, 2)
    np.testing.assert_array_equal(ours[f"block_{i}/moe/router/mu"], tree[f"{scope}/mu"])
    assert ours[f"block_{i}/moe/router/scale"].shape == ()
    assert ours[f"block_{i}/moe/router/scale"] == tree[f"{scope}/scale"]
    assert f"block_{i}/moe/router/dense/kernel" not in ours
  for i in range(LAYERS):
    for norm in ("query_ln", "key_ln"):
      got = ours[f"block_{i}/attention/{norm}/scale"]
      assert got.shape == (HEAD_DIM,)
      np.testing.assert_array_equal(
          got, tree[f"Encoder/encoderblock_{i}/SelfAttention/{norm}/scale"])
  np.testing.assert_array_equal(ours["map_head/attention/query_ln/scale"],
                                tree["MapHead/MultiHeadDotProductAttention/query_ln/scale"])
  # big_vision's names, scanned: the depth axis is split off as for every block parameter.
  bv = reference_tree("big_vision", qk_norm=True, scanned=True)
  stacked = bv["Transformer/encoderblock/MultiHeadDotProductAttention_0/key_ln/scale"]
  assert stacked.shape == (LAYERS, HEAD_DIM)
  bv_ours = mapping.to_ours(bv)
  for i in range(LAYERS):
    np.testing.assert_array_equal(bv_ours[f"block_{i}/attention/key_ln/scale"], stacked[i])
  assert not any("map_head" in name for name in bv_ours)


def test_misshaped_soft_moe_and_qk_norm_arrays_are_named():
  tree = reference_tree("vmoe", moe_layers=(1, 3), router="soft", slots=2, qk_norm=True)
  tree["Encoder/encoderblock_3/Moe/Router/mu"] = np.zeros((D, 5, 2), np.float32)  # 5 != E = 4
  tree["Encoder/encoderblock_1/Moe/Router/scale"] = np.ones((1,), np.float32)
  tree["Encoder/encoderblock_2/SelfAttention/query_ln/scale"] = np.ones((D,), np.float32)
  with pytest.raises(CheckpointError) as e:
    mapping.to_ours(tree)
  message = str(e.value)
  assert "Encoder/encoderblock_3/Moe/Router/mu: shape (32, 5, 2), expected (32, 4, ?)" in message
  assert "Encoder/encoderblock_1/Moe/Router/scale: shape (1,), expected ()" in message
  assert ("Encoder/encoderblock_2/SelfAttention/query_ln/scale: shape (32,), expected (16,)"
          in message)
  assert "3 problem(s)" in message


def test_model_hint_of_soft_moe_and_experts_choice_trees():
  soft = reference_tree("vmoe", moe_layers=(1, 3), experts=8, router="soft", slots=2,
                        qk_norm=True, classifier="gap")
  hint = mapping.model_hint({f"params/{n}": v for n, v in soft.items()})
  assert hint == {"layout": "vmoe", "hidden_size": D, "num_layers": LAYERS, "mlp_dim": MLP,
                  "num_heads": HEADS, "patch_size": PATCH, "image_size": IMAGE,
                  "classifier": "gap", "representation_size": None, "num_classes": CLASSES,
                  "moe_layers": (1, 3), "num_experts": 8, "ensemble_size": None,
                  "router": "soft", "slots_per_expert": 2}
  dense = mapping.model_hint(reference_tree("vmoe", moe_layers=(1, 3), classifier="gap"))
  assert (dense["router"], dense["slots_per_expert"], dense["ensemble_size"]) == (
      "token_choice or experts_choice", None, 1)  # the stored (D, 1, E) kernel
  assert mapping.model_hint(reference_tree("vmoe", qk_norm=True))["router"] is None
