"""DeepSeekMoE's shared and fine-grained experts (Dai et al. 2024, arXiv 2401.06066) in a
token-choice V-MoE (model.moe.shared_experts, model.moe.expert_split) against NumPy
transcriptions: a layer with K_s shared experts is the routed output plus the sum of K_s MLPs
applied to every token; E*m experts made by splitting E experts' MLPs into m column / row blocks
and routed k*m at a time compute what the E experts did; what is derived from the keys (experts,
k, width, capacity, FLOPs, parameters) and the defaults, which change nothing."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config import derived
from runner.models.size import active_params, count_params
from runner.models import build_model
from runner.models.catalog import UnknownModelError, model_config
from runner.models.flops import forward_flops_per_image
from runner.models.moe.layer import MoeMlpBlock
from runner.models.moe.routers import token_choice

D, MLP, E, K = 8, 16, 4, 2
IMAGES, TOKENS = 4, 5
# No drops (every assignment fits), no noise: the routing is a pure function of the gates.
ROUTER = {"k": K, "capacity_ratio": 4.0, "noise_std": 0.0}
NAMES = ("fc1_kernel", "fc1_bias", "fc2_kernel", "fc2_bias")


def _gelu(x):  # flax's nn.gelu: the tanh approximation
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _mlp(x, w1, b1, w2, b2):
  return _gelu(x @ w1 + b1) @ w2 + b2


def _inputs(seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).normal(size=(IMAGES, TOKENS, D)), jnp.float32)


def _random(shapes: dict, seed: int) -> dict:
  """Random parameters of these shapes (biases too, so that none is trivially zero)."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(0.5 * rng.normal(size=a.shape), jnp.float32), shapes)


def _apply(block: MoeMlpBlock, params: dict, x: jax.Array) -> np.ndarray:
  y, _ = block.apply({"params": params}, x, train=False)
  return np.asarray(y, np.float64)


def test_shared_experts_add_their_mlps_applied_to_every_token():
  block = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router=ROUTER, shared_experts=3)
  x = _inputs()
  boxed = block.init(jax.random.key(0), x, train=False)["params"]
  # K_s separate experts, replicated over the expert axis of a mesh.
  assert [tuple(boxed["shared"][n].names) for n in NAMES] == [
      (None, "embed", "mlp"), (None, "mlp"), (None, "mlp", "embed"), (None, "embed")]
  params = _random(nn.meta.unbox(boxed), seed=1)
  assert {n: params["shared"][n].shape for n in NAMES} == {
      "fc1_kernel": (3, D, MLP), "fc1_bias": (3, MLP), "fc2_kernel": (3, MLP, D),
      "fc2_bias": (3, D)}
  routed = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router=ROUTER)
  without = {k: v for k, v in params.items() if k != "shared"}
  xs = np.asarray(x, np.float64)
  shared = sum(_mlp(xs, *(np.asarray(params["shared"][n][i], np.float64) for n in NAMES))
               for i in range(3))
  want = _apply(routed, without, x) + shared
  np.testing.assert_allclose(_apply(block, params, x), want, rtol=1e-5, atol=1e-5)
  assert np.abs(shared).max() > 0.1


def _split(params: dict, m: int) -> dict:
  """A model of E*m fine-grained experts whose expert e*m + j is the j-th of m column blocks of
  expert e's first layer and row blocks of its second, with expert e's router column; its
  second layer is scaled by m (each of the m copies' gates is a 1/m of expert e's softmax
  weight), its bias kept whole, so that the E*m experts compute the E experts' output."""
  w1, b1, w2, b2 = (np.asarray(params["experts"][n]) for n in NAMES)
  h = MLP // m
  experts = {
      "fc1_kernel": w1.reshape(E, D, m, h).transpose(0, 2, 1, 3).reshape(E * m, D, h),
      "fc1_bias": b1.reshape(E * m, h),
      "fc2_kernel": m * w2.reshape(E * m, h, D),
      "fc2_bias": np.repeat(b2, m, axis=0),
  }
  kernel = np.repeat(np.asarray(params["router"]["dense"]["kernel"]), m, axis=1)
  return {"router": {"dense": {"kernel": jnp.asarray(kernel)}},
          "experts": {n: jnp.asarray(v, jnp.float32) for n, v in experts.items()}}


@pytest.mark.parametrize("m", [2, 4])
def test_split_experts_compute_the_unsplit_experts(m):
  x = _inputs(2)
  whole = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router=ROUTER)
  params = _random(nn.meta.unbox(whole.init(jax.random.key(0), x, train=False)["params"]), 3)
  fine = MoeMlpBlock(num_experts=E * m, mlp_dim=MLP // m, group_size=2,
                     router={**ROUTER, "k": K * m})
  split = _split(params, m)
  shapes = jax.tree_util.tree_map(np.shape, nn.meta.unbox(
      fine.init(jax.random.key(0), x, train=False)["params"]))
  assert jax.tree_util.tree_map(np.shape, split) == shapes
  y, metrics = fine.apply({"params": split}, x, train=False)
  assert float(metrics["fraction_dropped_assignments"]) == 0.0
  np.testing.assert_allclose(np.asarray(y), _apply(whole, params, x), rtol=1e-4, atol=1e-4)


def _tiny(**moe) -> "object":
  config = model_config("vmoe_tiny")
  return dataclasses.replace(config, moe=dataclasses.replace(config.moe, **moe))


def test_catalog_names_the_papers_setting():
  config = model_config("vmoe_tiny_s1_f2")
  assert (config.moe.shared_experts, config.moe.expert_split) == (1, 2)
  assert config == dataclasses.replace(_tiny(shared_experts=1, expert_split=2),
                                       name="vmoe_tiny_s1_f2")
  assert model_config("vmoe_b16_every2_e32_k2_s2_f4").moe.expert_split == 4
  with pytest.raises(UnknownModelError):
    model_config("vit_tiny_s1")


def test_derived_experts_k_width_and_capacity():
  plain, fine = _tiny(), _tiny(shared_experts=1, expert_split=2)
  assert (derived.num_experts(fine), derived.router(fine).k, derived.expert_width(fine),
          derived.shared_experts(fine)) == (16, 4, 256, 1)
  assert (derived.num_experts(plain), derived.expert_width(plain),
          derived.shared_experts(plain)) == (8, 512, 0)
  assert derived.router(plain) is plain.router
  # round(k*m*N*C/(E*m)) = round(k*N*C/E): as many slots per expert as before, each 1/m as wide.
  tokens = derived.tokens_per_group(plain)
  for train in (True, False):
    assert token_choice.TokenChoice.capacity(derived.router(fine), tokens, 16, train=train) == \
        token_choice.TokenChoice.capacity(plain.router, tokens, 8, train=train)
  vit = model_config("vit_tiny")
  assert (derived.num_experts(vit), derived.expert_split(vit), derived.shared_experts(vit)) == \
      (0, 1, 0)


@pytest.mark.parametrize("batch_size", [4, 64])
@pytest.mark.parametrize("train", [True, False])
def test_flops_of_split_and_shared_experts(batch_size, train):
  """Splitting keeps the experts' FLOPs; only the router's gates grow, to 2*T*D*E*m; a shared
  expert adds an MLP of the experts' width on every token of each MoE layer."""
  plain = _tiny()
  t, d, e, layers = 65, 128, 8, 2  # vmoe_tiny: 65 tokens, D=128, MoE blocks 1 and 3
  base = forward_flops_per_image(plain, 10, batch_size=batch_size, train=train)
  for m in (2, 4):
    split = forward_flops_per_image(_tiny(expert_split=m), 10, batch_size=batch_size,
                                    train=train)
    assert split == pytest.approx(base + layers * 2 * t * d * e * (m - 1), rel=1e-12)
    shared = forward_flops_per_image(_tiny(expert_split=m, shared_experts=2), 10,
                                     batch_size=batch_size, train=train)
    assert shared == pytest.approx(split + layers * 2 * (2 * 2 * t * d * 512 // m), rel=1e-12)


def _params(config) -> dict:
  """The model's parameters as shapes and dtypes (nothing computed)."""
  model = build_model(config, 10)
  x = jnp.zeros((1, 32, 32, 3))
  return nn.meta.unbox(jax.eval_shape(
      lambda: model.init(jax.random.key(0), x, train=False))["params"])


def _shapes(tree) -> dict:
  return jax.tree_util.tree_map(lambda a: tuple(a.shape), tree)


def test_parameters_and_active_parameters():
  pa, pb = _params(_tiny()), _params(_tiny(shared_experts=1, expert_split=2))
  layer = _shapes(pb["block_1"]["moe"])
  assert layer["experts"] == {"fc1_kernel": (16, 128, 256), "fc1_bias": (16, 256),
                              "fc2_kernel": (16, 256, 128), "fc2_bias": (16, 128)}
  assert layer["shared"] == {"fc1_kernel": (1, 128, 256), "fc1_bias": (1, 256),
                             "fc2_kernel": (1, 256, 128), "fc2_bias": (1, 128)}
  assert layer["router"]["dense"]["kernel"] == (128, 16)
  assert pa["block_1"]["moe"].keys() == {"router", "experts"}
  # Per MoE layer: the experts' kernels and first biases keep their sizes; the second biases
  # and the router columns double; the shared expert adds its own MLP.
  shared = 2 * 128 * 256 + 256 + 128
  assert count_params(pb) - count_params(pa) == 2 * (8 * 128 + 8 * 128 + shared)
  # Active: k*m of the E*m experts count (a k/E share of the expert weights), the shared whole.
  experts_a = count_params(pa["block_1"]["moe"]["experts"])
  experts_b = count_params(pb["block_1"]["moe"]["experts"])
  assert active_params(pb, 16, 4) - active_params(pa, 8, 2) == \
      2 * ((experts_b - experts_a) // 4 + 8 * 128 + shared)


def test_defaults_build_the_same_model():
  """shared_experts=0 and expert_split=1 hand the modules exactly the arguments of before."""
  model = build_model(_tiny(), 10)
  assert set(model.moe) == {"num_experts", "group_size", "expert_dropout", "dispatcher",
                            "router"}
  assert MoeMlpBlock.shared_experts == 0
  fine = build_model(_tiny(shared_experts=2, expert_split=4), 10)
  assert (fine.moe["num_experts"], fine.moe["mlp_dim"], fine.moe["shared_experts"],
          fine.moe["router"]["k"]) == (32, 128, 2, 8)
