"""runner.interop.mapping: released checkpoints' names onto our model, with logits parity.

Random parameter trees under the reference names of google-research/vmoe (V-MoE, E³), big_vision
and vision_transformer are mapped with `to_ours`, loaded into our model and run; the logits must
match a NumPy re-implementation of the reference forward pass (tests/formats/reference_vit.py,
float64) to 1e-5. Capacities are large enough that no token is dropped, as that reference assumes.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
from formats import reference_vit  # tests/ is on sys.path (conftest rootdir)
from formats.reference_tree import SUBLAYERS, reference_tree

from runner.checkpoint import CheckpointError
from runner.interop import mapping
from runner.models import build_model, model_config
from runner.models.transfer import flatten, unflatten
from runner.train.state import init_params

D, LAYERS, MLP, HEADS, PATCH, IMAGE, CLASSES = 32, 4, 64, 2, 4, 16, 10
TOKENS = (IMAGE // PATCH) ** 2
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
  fresh = flatten(init_params(model, (IMAGE, IMAGE, 3), 0)[0])
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
