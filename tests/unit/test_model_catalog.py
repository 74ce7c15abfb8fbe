"""Model-name grammar, size table (V-MoE paper, Table 7) and MoE placement."""
from __future__ import annotations

import dataclasses

import pytest

from runner.config import from_dict, sections
from runner.config.schema import ModelConfig, MoeConfig, RouterConfig
from runner.errors import ConfigError, UserError
from runner.models import UnknownModelError, build_model, is_moe, model_config, moe_layer_indices
from runner.models.catalog import CPU_MODELS, PAPER_MODELS, SIZES, SOFT_MOE_MODELS

# Table 7 (Blocks, Heads, Embed., MLP) for each ViT size.
TABLE_7 = {"s": dict(blocks=8, heads=8, embed=512, mlp=2048),
           "b": dict(blocks=12, heads=12, embed=768, mlp=3072),
           "l": dict(blocks=24, heads=16, embed=1024, mlp=4096),
           "h": dict(blocks=32, heads=16, embed=1280, mlp=5120)}


@pytest.mark.parametrize("size", sorted(TABLE_7))
def test_sizes_match_table_7(size):
  hidden, layers, mlp, heads = SIZES[size]
  want = TABLE_7[size]
  assert (hidden, layers, mlp, heads) == (want["embed"], want["blocks"], want["mlp"], want["heads"])


def test_vit_config_from_name():
  c = model_config("vit_b16")
  assert isinstance(c, ModelConfig)
  assert (c.hidden_size, c.num_layers, c.mlp_dim, c.num_heads) == (768, 12, 3072, 12)
  assert c.patch_size == 16 and c.image_size == 224
  assert not is_moe(c)
  assert build_model(c, 10).moe_layers == ()


def test_vmoe_config_defaults_and_overrides():
  c = model_config("vmoe_s32_last2")
  assert c.moe.num_experts == 32 and c.router.k == 2
  assert c.patch_size == 32 and c.num_layers == 8
  c = model_config("vmoe_b16_every2_e8_k1")
  # The name sets these; every other key keeps its schema default.
  assert c.moe == MoeConfig(layers="every2", num_experts=8) and c.router == sections.new(RouterConfig, k=1)
  tiny = model_config("vmoe_tiny")
  assert tiny.moe.num_experts == 8 and tiny.patch_size == 4 and tiny.image_size == 32
  assert is_moe(tiny)


def test_capacity_rounding_reaches_the_router():
  import dataclasses

  import jax
  import jax.numpy as jnp

  from runner.models.moe.routers.token_choice import CapacityRounding
  from runner.models.moe.routing import expert_capacity
  tiny = model_config("vmoe_tiny")
  assert tiny.router.capacity_rounding == CapacityRounding.paper
  assert "capacity_rounding" not in build_model(tiny, 10).moe["router"]  # arguments unchanged
  c = dataclasses.replace(tiny, router=dataclasses.replace(
      tiny.router, capacity_rounding=CapacityRounding.reference, eval_capacity_ratio=0.3))
  model = build_model(c, 10)
  assert model.moe["router"]["capacity_rounding"] == "reference"
  from runner.models.moe.routers.token_choice import NoisyTopKRouter

  def capacities(model):
    """The plan capacity of every router, read from shapes alone (no compute)."""
    images = jnp.zeros((8, 32, 32, 3))
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), images, train=False))
    _, state = jax.eval_shape(lambda v: model.apply(
        v, images, train=False, mutable=["intermediates"],
        capture_intermediates=lambda m, _: isinstance(m, NoisyTopKRouter)), variables)
    return [state["intermediates"][f"block_{i}"]["moe"]["router"]["__call__"][0][0].capacity
            for i in (1, 3)]
  # 8 images x 65 tokens per group, E=8, k=2, C=0.3: 39 slots (paper), 39 -> 40 (reference).
  assert capacities(model) == [40, 40] == [expert_capacity(8 * 65, 8, 2, 0.3, "reference")] * 2
  assert capacities(build_model(dataclasses.replace(
      c, router=dataclasses.replace(c.router, capacity_rounding=CapacityRounding.paper)),
      10)) == [39, 39]


@pytest.mark.parametrize("name,layers", [
    ("vmoe_s32_last2", (5, 7)),
    ("vmoe_s32_every2", (1, 3, 5, 7)),
    ("vmoe_b16_last2", (9, 11)),
    ("vmoe_b16_every2", (1, 3, 5, 7, 9, 11)),
    ("vmoe_l16_last2", (21, 23)),
    ("vmoe_h14_last5", (23, 25, 27, 29, 31)),
])
def test_paper_moe_placements(name, layers):
  c = model_config(name)
  assert moe_layer_indices(c.moe.layers, c.num_layers) == layers
  model = build_model(c, 10)
  assert tuple(model.moe_layers) == layers
  assert model.moe["num_experts"] == 32 and model.moe["router"]["k"] == 2


def test_moe_layer_indices_strings_and_lists():
  assert moe_layer_indices("every2", 4) == (1, 3)
  assert moe_layer_indices("every2", 5) == (0, 2, 4)  # ends at the last block
  assert moe_layer_indices("every1", 3) == (0, 1, 2)
  assert moe_layer_indices("every3", 8) == (1, 4, 7)
  assert moe_layer_indices("last1", 4) == (3,)
  assert moe_layer_indices("last2", 4) == (1, 3)
  assert moe_layer_indices([3, 0, 3], 4) == (0, 3)  # sorted, deduplicated
  assert moe_layer_indices([], 4) == ()


@pytest.mark.parametrize("layers,match", [
    ("last3", "only 2 every-2 blocks"),
    ("every0", "n >= 1"),
    ("first2", "expected 'every<n>'"),
    ([0, 4], r"out of range .*0\.\.3"),
    ([-1], "out of range"),
])
def test_moe_layer_indices_errors(layers, match):
  with pytest.raises(ValueError, match=match):
    moe_layer_indices(layers, 4)


@pytest.mark.parametrize("name", ["vit_x16", "vit_s32_last2", "vit_b16_e8", "vmoe_b16_every2_z3",
                                  "resnet50", "vit_b", "VIT_B16"])
def test_bad_names_raise_unknown_model_error_listing_valid_names(name):
  with pytest.raises(UnknownModelError) as e:
    model_config(name)
  message = str(e.value)
  assert repr(name) in message
  for valid in CPU_MODELS + PAPER_MODELS:
    assert valid in message
  assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("name", CPU_MODELS + PAPER_MODELS + SOFT_MOE_MODELS)
def test_every_listed_name_resolves(name):
  c = model_config(name)
  assert c.name == name
  assert is_moe(c) == (not name.startswith("vit"))


def test_explicit_layer_list_in_config_builds_those_moe_layers():
  c = dataclasses.replace(model_config("vit_tiny"),
                          moe=MoeConfig(layers=[0, 2], num_experts=4, group_size=4),
                          router=sections.new(RouterConfig, k=1, capacity_ratio=2.0))
  model = build_model(c, 10)
  assert tuple(model.moe_layers) == (0, 2)
  assert model.moe["group_size"] == 4 and model.moe["num_experts"] == 4
  # The router receives exactly the schema's router keys, enums as the strings it takes.
  assert model.moe["router"] == dict(k=1, capacity_ratio=2.0, eval_capacity_ratio=None,
                                     batch_priority=False, priority="max", noise_std=1.0)
  assert model.moe["dispatcher"] == "indices" and type(model.moe["dispatcher"]) is str


def test_unknown_router_key_is_a_config_error():
  """A key the router does not understand fails when the typed config is built, not later."""
  with pytest.raises(ConfigError, match="unknown_key"):
    from_dict(ModelConfig, {"name": "vit_tiny", "router": {"k": 1, "unknown_key": 1}})


def test_zero_experts_means_dense():
  c = dataclasses.replace(model_config("vit_tiny"), moe=MoeConfig(layers="every2", num_experts=0))
  assert not is_moe(c)
  assert build_model(c, 10).moe is None
