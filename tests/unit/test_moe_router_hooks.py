"""What the rest of vmoe asks a router family (`RouterFamily` hooks), and what a plug-in that
overrides only what it must gets from the defaults: the MoE layer's sown records, the routing
analysis' views and dropped-patch maps, and fine-tuning across families."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config import sections
from runner.config.schema import RouterConfig
from runner.evaluators import routing_analysis as ra
from runner.models.moe import routers
from runner.models.moe.layer import MoeMlpBlock
from runner.models.moe.routers.experts_choice import ExpertsChoiceRouter
from runner.models.transfer import routers_fit

E, TOKENS, D = 4, 6, 8
BUILT_IN = ("token_choice", "experts_choice", "soft")


class Plain(routers.RouterFamily):
  """A plug-in as docs/extending.md writes one: experts-choice routing, no optional hook."""
  name = "plain_test"
  module = ExpertsChoiceRouter
  summary = "a test family with every default"

  @classmethod
  def module_kwargs(cls, router, *, tokens, experts):
    return dict(capacity_ratio=router.capacity_ratio)

  @classmethod
  def capacity(cls, router, tokens, experts, *, train):
    return max(1, round(tokens * router.capacity_ratio / experts))

  @classmethod
  def experts_per_token(cls, router, tokens, experts, capacity):
    return experts * capacity / tokens


def _sown(router: dict, *, ensemble_size: int = 1, variant: str = "pbe", images: int = 4,
          seed: int = 0) -> dict:
  """{record name: array} an MoE layer sows for `images` random images."""
  block = MoeMlpBlock(num_experts=E, mlp_dim=16, group_size=2, router=router,
                      ensemble_size=ensemble_size, ensemble_variant=variant)
  rows = images * ensemble_size if variant != "partition_only" else images
  x = jax.random.normal(jax.random.key(seed), (rows, TOKENS, D))
  params = block.init(jax.random.key(1), x, train=False)["params"]
  _, state = block.apply({"params": params}, x, train=False, mutable=["intermediates"])
  return {name: np.asarray(value[-1]) for name, value in state["intermediates"].items()}


@pytest.fixture
def plain(monkeypatch):
  """`Plain`, found by its name for this test only (registering would add it for good)."""
  found = routers.family
  monkeypatch.setattr(routers, "family",
                      lambda name: Plain if name == Plain.name else found(name))
  return Plain


def test_a_plug_in_with_the_defaults_sows_weights_and_masks_only(plain):
  records = _sown({"type": plain.name, "capacity_ratio": 1.0})
  assert list(records) == ["expert_weights", "expert_mask", "routed_mask"]
  # The same routing as experts-choice's, whose extra hooks sow nothing more.
  want = _sown({"type": "experts_choice", "capacity_ratio": 1.0, "noise_std": 0.0})
  for name, value in records.items():
    np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_a_plug_in_with_the_defaults_has_no_extra_analysis(plain):
  assert plain.analysis_views == () and plain.expert_ids(None, True) is None
  assert plain.sown_records(None) == {}
  info = ra.LayerInfo(family=plain.name, router=sections.new(RouterConfig), experts=E, members=1,
                      group_size=2, tokens=TOKENS, grid=(2, 3), class_token=False, k=2)
  weights = np.random.default_rng(0).dirichlet(np.ones(E), size=(4, TOKENS)).astype(np.float32)
  assert ra.dropped_patches(weights, info, [0.5, 1.0]) == {}


@pytest.mark.parametrize("name, records", [
    ("token_choice", ["expert_weights", "selected_experts", "routed_experts", "expert_mask",
                      "routed_mask"]),
    ("experts_choice", ["expert_weights", "expert_mask", "routed_mask"]),
    ("soft", ["expert_weights", "dispatch_weights", "combine_weights"]),
])
def test_each_family_sows_what_its_hooks_say(name, records):
  sown = _sown({"type": name})
  assert list(sown) == records
  assert all(value.shape[:2] == (4, TOKENS) for value in sown.values())


@pytest.mark.parametrize("variant", ["pbe", "tiling_only", "partition_only"])
def test_ensemble_masks_are_the_sets_of_the_sown_expert_ids(variant):
  """Masks laid out per image from each member's plan hold exactly the global ids sown."""
  sown = _sown({"capacity_ratio": 0.6, "k": 1}, ensemble_size=2, variant=variant)
  for ids, mask in (("selected_experts", "expert_mask"), ("routed_experts", "routed_mask")):
    from_ids = np.any(np.asarray(jax.nn.one_hot(sown[ids], E, dtype=jnp.bool_)), axis=-2)
    np.testing.assert_array_equal(sown[mask], from_ids, err_msg=mask)
  assert (sown["routed_experts"] == -1).any()  # a capacity that drops some assignments


def test_families_say_which_checkpoint_routers_fit_theirs():
  """A released checkpoint (no config) is told by its router parameters: token- and
  experts-choice share the (D, E) gate kernel; Soft MoE has slots and a scale."""
  kernel = {"block_1": {"moe": {"router": {"dense": {"kernel": np.zeros((D, E))}}}}}
  slots = {"block_1": {"moe": {"router": {"mu": np.zeros((D, E, 1)), "scale": np.ones(())}}}}
  vit = {"block_1": {"mlp": {"fc1": {"kernel": np.zeros((D, 16))}}}}
  fits = {(tree, name): routers_fit(params, routers.family(name))
          for tree, params in (("kernel", kernel), ("slots", slots)) for name in BUILT_IN}
  assert fits == {("kernel", "token_choice"): True, ("kernel", "experts_choice"): True,
                  ("kernel", "soft"): False, ("slots", "token_choice"): False,
                  ("slots", "experts_choice"): False, ("slots", "soft"): True}
  assert routers_fit(kernel, Plain)  # the default: a gate kernel, as docs/extending.md's
  assert all(routers_fit(vit, routers.family(name)) for name in BUILT_IN)
