"""Dropless token-choice routing (`model.router.dropless=true`): every (token, choice) assignment
is processed, the experts run as grouped matmuls (`jax.lax.ragged_dot`) over the assignments
sorted by expert. Against a NumPy transcription (each token's output is the sum over its TOP-k
experts of gate * MLP_e(x)), against the capacity path at a capacity that drops nothing (outputs,
metrics and gradients), with sigmoid gates, shared and fine-grained experts and expert dropout;
what it sows, its FLOPs, and what the config refuses (exit 2, one paragraph), through the CLI
with a tiny pretrain and evaluations that switch a checkpoint between capacity and dropless."""
from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import QUIET, TINY_MODEL, fails_clearly
from runner.config import resolve, sections
from runner.config.mesh import expert_mesh_axes
from runner.config.schema import ModelConfig, RouterConfig
from runner.models import model_config
from runner.models.flops import forward_flops_per_image
from runner.models.moe import dispatch
from runner.models.moe.layer import MoeMlpBlock
from runner.models.moe.routers.token_choice import TokenChoice

D, MLP, E, K = 8, 16, 4, 2
IMAGES, TOKENS = 4, 5
NAMES = ("fc1_kernel", "fc1_bias", "fc2_kernel", "fc2_bias")
DROPLESS = {"k": K, "noise_std": 0.0, "dropless": True}
# The capacity path with buffers of S slots (C = E / k: round(k * S * C / E) = S), which no
# expert can overflow: it drops nothing either.
ROOMY = {"k": K, "noise_std": 0.0, "capacity_ratio": E / K}


def _gelu(x):  # flax's nn.gelu: the tanh approximation
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _inputs(seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).normal(size=(IMAGES, TOKENS, D)), jnp.float32)


def _params(block: MoeMlpBlock, x: jax.Array, seed: int) -> dict:
  """Random parameters of the block's shapes, biases and router too (none trivially zero)."""
  boxed = jax.eval_shape(lambda: block.init(jax.random.key(0), x, train=False))
  shapes = nn.meta.unbox(boxed)["params"]
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(0.5 * rng.normal(size=a.shape), jnp.float32), shapes)


def dropless_reference(x, kernel, experts, k: int, gate: str = "softmax") -> np.ndarray:
  """Per token t: y_t = sum over its TOP-k experts e (largest gate first, ties to the lower id)
  of g_e * MLP_e(x_t), g the softmax of x W, or for sigmoid gates the TOP-k of sigmoid(x W)
  normalized to sum to 1. Nothing is dropped."""
  x = np.asarray(x, np.float64)
  w1, b1, w2, b2 = (np.asarray(experts[n], np.float64) for n in NAMES)
  logits = x @ np.asarray(kernel, np.float64)
  scores = _softmax(logits) if gate == "softmax" else 1 / (1 + np.exp(-logits))
  y = np.zeros_like(x)
  for index in np.ndindex(x.shape[:-1]):
    s = scores[index]
    top = np.argsort(-s, kind="stable")[:k]
    weights = s[top] if gate == "softmax" else s[top] / s[top].sum()
    for e, g in zip(top, weights):
      y[index] += g * (_gelu(x[index] @ w1[e] + b1[e]) @ w2[e] + b2[e])
  return y


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_each_token_sums_its_top_k_experts(gate, k):
  x = _inputs(1)
  block = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2,
                      router={**DROPLESS, "k": k, "gate": gate})
  params = _params(block, x, seed=2)
  y, metrics = block.apply({"params": params}, x, train=False)
  want = dropless_reference(x, params["router"]["dense"]["kernel"], params["experts"], k, gate)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5)
  assert float(metrics["fraction_dropped_tokens"]) == 0.0
  assert float(metrics["fraction_dropped_assignments"]) == 0.0


def test_a_capacity_that_drops_would_change_the_output():
  """The comparison above means something: at C = 0.5 the capacity path drops assignments and
  differs from the dropless output."""
  x = _inputs(3)
  block = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router=DROPLESS)
  params = _params(block, x, seed=4)
  dropping = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2,
                         router={**ROOMY, "capacity_ratio": 0.5})
  y, _ = block.apply({"params": params}, x, train=False)
  z, metrics = dropping.apply({"params": params}, x, train=False)
  assert float(metrics["fraction_dropped_assignments"]) > 0
  assert np.abs(np.asarray(y) - np.asarray(z)).max() > 1e-3


def _loss(block, params, x, train: bool):
  y, metrics = block.apply({"params": params}, x, train=train,
                           rngs={"gating": jax.random.key(7)})
  return jnp.sum(jnp.sin(y)) + metrics["auxiliary_loss"], (y, metrics)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("moe", [{}, {"shared_experts": 1}], ids=["routed", "shared"])
def test_equal_to_the_capacity_path_when_nothing_drops(train, moe):
  """Outputs, metrics and the gradients of parameters and inputs, with routing noise (train)
  and a shared expert."""
  x = _inputs(5)
  noise = {"noise_std": 1.0} if train else {}
  dropless = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2,
                         router={**DROPLESS, **noise}, **moe)
  capacity = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2,
                         router={**ROOMY, **noise}, **moe)
  params = _params(dropless, x, seed=6)
  grad = lambda block: jax.jit(jax.grad(lambda p, v: _loss(block, p, v, train), argnums=(0, 1),
                                        has_aux=True))(params, x)
  (got_params, got_x), (y, metrics) = grad(dropless)
  (want_params, want_x), (y_want, metrics_want) = grad(capacity)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_want), rtol=1e-5, atol=1e-6)
  assert float(metrics_want["fraction_dropped_assignments"]) == 0.0
  for name in ("auxiliary_loss", "importance_loss", "expert_load", "fraction_dropped_tokens",
               "max_violation", "dead_experts", "saturated_experts"):
    np.testing.assert_allclose(np.asarray(metrics[name]), np.asarray(metrics_want[name]),
                               rtol=1e-6, err_msg=name)
  np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-4, atol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got_params)[0],
                          jax.tree.leaves(want_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
  assert np.abs(np.asarray(got_params["router"]["dense"]["kernel"])).max() > 0


def test_a_balance_bias_chooses_as_with_capacity():
  """Auxiliary-loss-free balancing (balance=bias): the bias chooses the TOP-k, the unbiased
  scores weigh them, and training sows the loads the bias update reads, as the capacity path
  does where it drops nothing."""
  x = _inputs(17)
  biased = {"balance": "bias"}
  dropless = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router={**DROPLESS, **biased})
  capacity = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router={**ROOMY, **biased})
  params = _params(dropless, x, seed=18)
  run = lambda block: block.apply({"params": params}, x, train=True,
                                  rngs={"gating": jax.random.key(0)},
                                  mutable=["balance_loads", "intermediates"])
  (y, _), sown = run(dropless)
  (want, _), sown_want = run(capacity)
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)
  (loads,) = jax.tree.leaves(sown["balance_loads"])
  np.testing.assert_array_equal(np.asarray(loads),
                                np.asarray(jax.tree.leaves(sown_want["balance_loads"])[0]))
  assert loads.shape == (1, E) and int(loads.sum()) == IMAGES * TOKENS * K
  unbiased = dict(params, router={"dense": params["router"]["dense"],
                                  "balance_bias": jnp.zeros(E)})
  (_, _), sown_unbiased = dropless.apply({"params": unbiased}, x, train=True,
                                         rngs={"gating": jax.random.key(0)},
                                         mutable=["balance_loads", "intermediates"])
  chosen = lambda s: np.asarray(s["intermediates"]["selected_experts"][0])
  assert (chosen(sown) != chosen(sown_unbiased)).any()  # the bias changed some choices


def test_fine_grained_experts():
  """E*m experts of width mlp_dim/m, k*m chosen: the reference with k*m, as the capacity path
  with room for everything."""
  m = 2
  x = _inputs(8)
  router = {**DROPLESS, "k": K * m}
  block = MoeMlpBlock(num_experts=E * m, mlp_dim=MLP // m, group_size=2, router=router)
  params = _params(block, x, seed=9)
  y, _ = block.apply({"params": params}, x, train=False)
  want = dropless_reference(x, params["router"]["dense"]["kernel"], params["experts"], K * m)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5)


def test_expert_dropout_applies_in_training_only():
  x = _inputs(10)
  block = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router=DROPLESS,
                      expert_dropout=0.5)
  params = _params(block, x, seed=11)
  plain, _ = block.apply({"params": params}, x, train=False)
  reference = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router=DROPLESS)
  np.testing.assert_array_equal(np.asarray(plain),
                                np.asarray(reference.apply({"params": params}, x, train=False)[0]))
  rngs = lambda seed: {"dropout": jax.random.key(seed), "gating": jax.random.key(0)}
  a, _ = block.apply({"params": params}, x, train=True, rngs=rngs(1))
  b, _ = block.apply({"params": params}, x, train=True, rngs=rngs(1))
  c, _ = block.apply({"params": params}, x, train=True, rngs=rngs(2))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.abs(np.asarray(a) - np.asarray(plain)).max() > 1e-3
  assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-3


def test_layout_sorts_every_assignment_by_expert():
  rng = np.random.default_rng(12)
  experts = rng.integers(0, E, size=(3, 6, K))
  experts[..., 1] = (experts[..., 0] + 1 + rng.integers(0, E - 1, size=(3, 6))) % E  # distinct
  weights = rng.uniform(size=(3, 6, K)).astype(np.float32)
  plan = dispatch.DroplessPlan(experts=jnp.asarray(experts, jnp.int32),
                               combine_weights=jnp.asarray(weights), num_experts=E, k=K)
  layout = plan.layout()
  flat = experts.reshape(-1)
  np.testing.assert_array_equal(np.asarray(layout.group_sizes), np.bincount(flat, minlength=E))
  np.testing.assert_array_equal(np.asarray(layout.order), np.argsort(flat, kind="stable"))
  np.testing.assert_array_equal(np.asarray(layout.experts), np.sort(flat))
  np.testing.assert_array_equal(np.asarray(layout.inverse)[np.asarray(layout.order)],
                                np.arange(flat.size))
  x = rng.normal(size=(3, 6, D)).astype(np.float32)
  rows = np.asarray(plan.rows(jnp.asarray(x), layout))
  np.testing.assert_array_equal(rows, x.reshape(18, D)[np.argsort(flat, kind="stable") // K])
  # Rows back to tokens: sum_i w_i * row(i); with each row its token, that is sum_i w_i * x.
  back = np.asarray(plan.combine_rows(jnp.asarray(rows), layout))
  np.testing.assert_allclose(back, x * weights.sum(-1, keepdims=True), rtol=1e-6)
  assert plan.capacity == 6 and bool(plan.kept.all())
  np.testing.assert_array_equal(np.asarray(plan.expert_of_slot_filled),
                                [np.bincount(g.reshape(-1), minlength=E) for g in experts])


def test_routed_equals_selected_in_what_the_layer_sows():
  x = _inputs(13)
  block = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router=DROPLESS)
  params = _params(block, x, seed=14)
  _, state = block.apply({"params": params}, x, train=False, mutable=["intermediates"])
  sown = {name: np.asarray(value[0]) for name, value in state["intermediates"].items()}
  assert sown["selected_experts"].shape == (IMAGES, TOKENS, K)
  np.testing.assert_array_equal(sown["routed_experts"], sown["selected_experts"])
  np.testing.assert_array_equal(sown["routed_mask"], sown["expert_mask"])
  assert sown["expert_mask"].sum(-1).tolist() == [[K] * TOKENS] * IMAGES
  logits = np.asarray(x, np.float64) @ np.asarray(params["router"]["dense"]["kernel"])
  np.testing.assert_array_equal(sown["selected_experts"],
                                np.argsort(-_softmax(logits), -1, kind="stable")[..., :K])


def test_a_partitioned_ensemble_is_refused_by_the_layer():
  block = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router=DROPLESS,
                      ensemble_size=2)
  with pytest.raises(ValueError, match="partitioned batch ensembles"):
    block.init(jax.random.key(0), _inputs(), train=False)


# --- what the family answers ---------------------------------------------------------------------

def _tiny(**router) -> ModelConfig:
  config = model_config("vmoe_tiny")
  return dataclasses.replace(config, router=dataclasses.replace(config.router, **router))


@pytest.mark.parametrize("batch_size", [4, 64])
@pytest.mark.parametrize("train", [True, False])
def test_flops_count_k_experts_per_token(batch_size, train):
  """Dropless: the gates and exactly k expert MLPs per token, no capacity padding; against the
  dense twin, each MoE layer adds 2*T*D*E for the gates and (k - 1) MLPs per token."""
  t, d, e, h, layers = 65, 128, 8, 512, 2  # vmoe_tiny: 65 tokens, 8 experts on blocks 1 and 3
  dense = forward_flops_per_image(model_config("vit_tiny"), 10, batch_size=batch_size,
                                  train=train)
  dropless = forward_flops_per_image(_tiny(dropless=True), 10, batch_size=batch_size,
                                     train=train)
  assert dropless == pytest.approx(dense + layers * (2 * t * d * e + (K - 1) * 4 * t * d * h),
                                   rel=1e-12)
  capacity = forward_flops_per_image(_tiny(), 10, batch_size=batch_size, train=train)
  assert capacity > dropless  # C = 1.05 pads: round(k * N * 1.05 / E) slots per expert


def test_the_defaults_build_the_same_module_arguments():
  kwargs = TokenChoice.module_kwargs(sections.new(RouterConfig), tokens=TOKENS, experts=E)
  assert "dropless" not in kwargs
  assert TokenChoice.module_kwargs(sections.new(RouterConfig, dropless=True), tokens=TOKENS,
                                   experts=E)["dropless"] is True
  routing_config = TokenChoice.torch_routing(sections.new(RouterConfig), tokens=TOKENS, experts=E).config
  assert "dropless" not in routing_config
  assert TokenChoice.torch_routing(sections.new(RouterConfig, dropless=True), tokens=TOKENS,
                                   experts=E).config["dropless"] is True
  assert TokenChoice.dropped_at_capacity(sections.new(RouterConfig, dropless=True), jnp.ones((1, 4, E)), 1) == {}


def test_a_later_stage_switches_a_checkpoint_between_capacity_and_dropless():
  """A checkpoint trained at capacity (with non-default capacity keys) evaluated with
  dropless=true: its capacity keys fall back to their defaults, which dropless reads none of;
  one trained dropless evaluated with dropless=false routes at the default capacity."""
  stored = {"data": {"name": "mnist5k"},
            "model": {"name": "vmoe_tiny", "moe": {"layers": [1], "num_experts": 8},
                      "router": {"k": 2, "capacity_ratio": 1.25, "eval_capacity_ratio": 0.5,
                                 "capacity_rounding": "reference", "batch_priority": True}}}
  model, _ = resolve.stored_model_and_data(stored, {"router": {"dropless": True}})
  router = model.router
  assert router.dropless and router.capacity_ratio == 1.05 and router.eval_capacity_ratio is None
  assert (str(router.capacity_rounding.value), router.batch_priority) == ("paper", False)
  assert TokenChoice.problem(model) is None
  given = {"router": {"dropless": True, "capacity_ratio": 0.5}}
  model, _ = resolve.stored_model_and_data(stored, given)
  assert "model.router.capacity_ratio=0.5 means nothing with model.router.dropless=true" in \
      TokenChoice.problem(model)
  back = {**stored, "model": {**stored["model"], "router": {"k": 2, "dropless": True}}}
  model, _ = resolve.stored_model_and_data(back, {"router": {"dropless": False}})
  assert not model.router.dropless and model.router.capacity_ratio == 1.05


def test_which_sharding_splits_the_experts():
  """What the expert-parallelism refusal reads: the mesh axes of the experts' logical axis."""
  assert expert_mesh_axes("dp") == ()
  assert expert_mesh_axes("ep") == expert_mesh_axes("fsdp_ep") == ("expert",)
  assert expert_mesh_axes("ep", [["embed", "data"]]) == ()  # FSDP alone: gathered, allowed
  assert expert_mesh_axes("dp", [["expert", ["data", "expert"]]]) == ("data", "expert")
  assert expert_mesh_axes("dp", [["expert", None], ["expert", "expert"]]) == ()  # the first wins


def test_a_bfloat16_layer_trains():
  x = _inputs(15)
  block = MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, router=DROPLESS,
                      dtype=jnp.bfloat16)
  params = _params(block, x, seed=16)
  loss = lambda p: block.apply({"params": p}, x, train=False)[0].astype(jnp.float32).sum()
  grads = jax.grad(loss)(params)
  assert all(g.dtype == jnp.float32 and bool(jnp.isfinite(g).all())
             for g in jax.tree.leaves(grads))
  y, _ = block.apply({"params": params}, x, train=False)
  want = dropless_reference(x, params["router"]["dense"]["kernel"], params["experts"], K)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=0.05, atol=0.05)


# --- through the CLI -----------------------------------------------------------------------------

TRAIN = [*TINY_MODEL, *QUIET, "train.steps=2", "schedule.warmup_steps=0", "data.batch_size=16"]


@pytest.mark.parametrize("args, expected", [
    (["sharding=ep"], ["model.router.dropless=true cannot run under sharding=ep",
                       "all-to-all", "sharding=dp", "model.router.dropless=false"]),
    (["sharding=fsdp_ep"], ["cannot run under sharding=fsdp_ep", "expert parallelism"]),
    (["sharding.rules=[[expert,data]]"], ["cannot run under sharding.rules=", "sharding=dp"]),
    (["model.router.batch_priority=true"],
     ["model.router.batch_priority=true means nothing with model.router.dropless=true",
      "drops none", "model.router.dropless=false"]),
    (["model.router.capacity_ratio=2"],
     ["model.router.capacity_ratio=2 means nothing with model.router.dropless=true",
      "no buffer to size", "model.router.dropless=false"]),
    (["model.router.eval_capacity_ratio=0.5"],
     ["model.router.eval_capacity_ratio=0.5 means nothing with model.router.dropless=true",
      "model.router.dropless=false model.router.capacity_ratio=<C>"]),
    (["model.router.capacity_rounding=reference"],
     ["model.router.capacity_rounding=reference means nothing with model.router.dropless=true",
      "no buffers"]),
    (["model=vmoe_tiny_k1_m2"],
     ["model.router.dropless=true cannot be used with a partitioned batch ensemble",
      "model.moe.ensemble_size=2", "model.moe.ensemble_size=1"]),
    (["model=ecmoe_tiny"],
     ["model.router.dropless=true means nothing for model.router.type=experts_choice"]),
], ids=lambda v: " ".join(v)[:40])
def test_refusals(args, expected, run_cli, tmp_path):
  workdir = tmp_path / "w"
  fails_clearly(run_cli("pretrain", f"workdir={workdir}", *TRAIN, "model.router.dropless=true",
                        *args), *expected)
  assert not workdir.exists()


@pytest.fixture(scope="module")
def dropless_run(tmp_path_factory):
  from runner import cli
  workdir = tmp_path_factory.mktemp("dropless") / "run"
  assert cli.main(["pretrain", f"workdir={workdir}", *TRAIN, "model.router.dropless=true",
                   "model.router.gate=sigmoid", "model.moe.shared_experts=1",
                   "model.moe.expert_split=2", "model.moe.expert_dropout=0.1",
                   "model.router.balance=bias"]) == 0
  return workdir


def test_pretrain_logs_no_dropped_token_and_evaluates(dropless_run):
  """Sigmoid gates, a shared expert, fine-grained experts, expert dropout and the balance bias,
  dropless."""
  records = [json.loads(line) for line in (dropless_run / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if "train/loss" in r]
  assert train and all(r["moe/layer_1/fraction_dropped_tokens"] == 0.0 for r in train)
  assert all(r["moe/layer_1/fraction_dropped_assignments"] == 0.0 for r in train)
  assert len(train[-1]["moe/layer_1/expert_load"]) == 16  # 8 experts split in 2
  assert np.isfinite(train[-1]["train/loss"])
  from runner.checkpoints import weights
  bias = weights.load(str(dropless_run))[0]["block_1"]["moe"]["router"]["balance_bias"]
  assert np.abs(np.asarray(bias)).max() > 0  # the train step moved it from the sown loads
  summary = json.loads((dropless_run / "summary.json").read_text())
  assert 0 <= summary["val/prec@1"] <= 1
  assert summary["val/moe/layer_1/fraction_dropped_tokens"] == 0.0


def test_eval_switches_capacity_and_dropless(dropless_run, shared_run, run_cli, tmp_path):
  """The dropless checkpoint evaluated with the routing analysis and PGD (routed ==
  selected: no dropped token); then at a capacity that drops, where the sweep means something;
  and a capacity checkpoint evaluated dropless."""
  code, _, err = run_cli("eval", f"workdir={tmp_path / 'a'}", f"init.checkpoint={dropless_run}",
                         *QUIET, "eval.routing_analysis=true", "eval.adversarial.steps=1",
                         "eval.adversarial.epsilons=[0.01]", "eval.adversarial.max_examples=16")
  assert code == 0, err
  summary = json.loads((tmp_path / "a" / "summary.json").read_text())
  assert summary["routing/layer_1/dropped_fraction"] == 0.0
  assert summary["routing/layer_1/experts_per_token"] == 4.0  # k*m = 2*2, every one processed
  assert summary["mnist5k/moe/layer_1/fraction_dropped_tokens"] == 0.0
  assert 0 <= summary["mnist5k/pgd/eps_0.01/routing_change/layer_1"] <= 1
  fails_clearly(run_cli("eval", f"workdir={tmp_path / 'b'}", f"init.checkpoint={dropless_run}",
                        *QUIET, "eval.capacity_sweep=[0.5]"),
                "eval.capacity_sweep=[0.5] has nothing to sweep", "model.router.dropless=false")
  fails_clearly(run_cli("eval", f"workdir={tmp_path / 'c'}", f"init.checkpoint={dropless_run}",
                        *QUIET, "model.router.capacity_ratio=0.5"),
                "model.router.capacity_ratio=0.5 means nothing with model.router.dropless=true")
  code, _, err = run_cli("eval", f"workdir={tmp_path / 'd'}", f"init.checkpoint={dropless_run}",
                         *QUIET, "model.router.dropless=false", "model.router.capacity_ratio=0.5",
                         "eval.capacity_sweep=[0.25]")
  assert code == 0, err
  summary = json.loads((tmp_path / "d" / "summary.json").read_text())
  assert summary["mnist5k/moe/layer_1/fraction_dropped_tokens"] > 0
  assert "capacity_sweep/C_0.25/vanilla/prec@1" in summary
  code, _, err = run_cli("eval", f"workdir={tmp_path / 'e'}",
                         f"init.checkpoint={shared_run('vmoe_2steps')}", *QUIET,
                         "model.router.dropless=true")
  assert code == 0, err
  summary = json.loads((tmp_path / "e" / "summary.json").read_text())
  assert summary["mnist5k/moe/layer_1/fraction_dropped_tokens"] == 0.0
