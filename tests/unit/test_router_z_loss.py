"""ST-MoE's router z-loss (model.router.z_loss_weight; Zoph et al. 2022, eq. 5) against a NumPy
transcription of the paper's equation, in the token- and experts-choice routers, in the model's
training loss (its own weight, apart from train.aux_loss_weight), and where it means nothing
(Soft MoE, a dense ViT, a negative weight): refused before any compute. Off by default, where the
model and its train step are as they were. The z-loss reaches the loss as any router's own loss
does (routers.LOSSES): a plug-in's router with a loss of its own is tested through the same
record."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner import builtins
from runner.config import from_dict
from runner.config.schema import ModelConfig
from runner.config.validate import problems
from runner.models import build_model
from runner.config import registries
from runner.models.moe import routers, z_loss
from runner.models.moe.routers.experts_choice import ExpertsChoiceRouter
from runner.models.moe.routers.token_choice import NoisyTopKRouter, TokenChoice
from runner.train import objectives
from runner.train.state import abstract_params

G, S, D, E = 3, 10, 6, 4


def z_loss_reference(logits) -> float:
  """Eq. 5: L_z(x) = 1/B sum_{i=1..B} (log sum_{j=1..N} e^{x_j^(i)})^2, B tokens, N experts."""
  x = np.asarray(logits, np.float64).reshape(-1, np.shape(logits)[-1])
  return float(np.mean([np.log(np.sum(np.exp(row))) ** 2 for row in x]))


def _inputs(seed=0, scale=3.0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(G, S, D)).astype(np.float32)
  kernel = (scale * rng.normal(size=(D, E))).astype(np.float32)
  return x, kernel


def test_z_loss_is_the_papers_equation():
  logits = np.random.default_rng(1).normal(scale=5.0, size=(G, S, E)).astype(np.float32)
  assert float(z_loss.z_loss(jnp.asarray(logits))) == pytest.approx(z_loss_reference(logits),
                                                                      rel=1e-5)
  # Large logits: the log-sum-exp is computed stably (a naive exp would overflow float32).
  big = np.full((2, E), 100.0, np.float32)
  assert float(z_loss.z_loss(jnp.asarray(big))) == pytest.approx((100 + np.log(E)) ** 2, rel=1e-6)


@pytest.mark.parametrize("module", [
    NoisyTopKRouter(num_experts=E, k=2, capacity_ratio=E, z_loss_weight=0.01),
    ExpertsChoiceRouter(num_experts=E, z_loss_weight=0.01)])
def test_each_router_reports_the_z_loss_of_its_logits_before_noise(module):
  """The router's logits x W (noise on, in training: ST-MoE's x are the router's logits, not the
  noisy scores); without a weight there is no z_loss metric at all."""
  x, kernel = _inputs()
  params = {"dense": {"kernel": jnp.asarray(kernel)}}
  _, metrics = module.apply({"params": params}, jnp.asarray(x), train=True,
                            rngs={"gating": jax.random.key(0)})
  want = z_loss_reference(np.einsum("gsd,de->gse", x.astype(np.float64), kernel))
  assert float(metrics["z_loss"]) == pytest.approx(want, rel=1e-5)
  _, plain = module.clone(z_loss_weight=0.0).apply(
      {"params": params}, jnp.asarray(x), train=True, rngs={"gating": jax.random.key(0)})
  assert "z_loss" not in plain


_TINY = dict(name="z_test", image_size=8, patch_size=2, hidden_size=16, num_layers=2, mlp_dim=32,
             num_heads=2, moe=dict(layers=[0, 1], num_experts=4, group_size=4))


def _inputs_of(model) -> tuple:
  """Random parameters of `model` (8x8 images), a batch of 4 and the training rngs."""
  shapes, _ = abstract_params(model, (8, 8, 3))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: jnp.asarray(0.5 * rng.normal(size=s.shape), s.dtype), shapes)
  batch = {"image": jnp.asarray(rng.normal(size=(4, 8, 8, 3)), jnp.float32),
           "labels": jnp.asarray(np.eye(3, dtype=np.float32)[[0, 1, 2, 0]])}
  return params, batch, {"gating": jax.random.key(1), "dropout": jax.random.key(2)}


@pytest.mark.parametrize("router", [dict(type="token_choice", k=2), dict(type="experts_choice")])
def test_the_training_loss_adds_c_z_times_the_layers_z_losses(router):
  """total = classification + aux_loss_weight * auxiliary + c_z * sum over layers of L_z, and
  train/z_loss is the last term; with c_z = 0 the loss and metrics are as before."""
  builtins.register()
  weighted = from_dict(ModelConfig, dict(_TINY, router=dict(router, z_loss_weight=0.5)))
  plain = from_dict(ModelConfig, dict(_TINY, router=router))
  model, base = build_model(weighted, 3), build_model(plain, 3)
  params, batch, rngs = _inputs_of(model)
  total, metrics = objectives.classification(model, loss="softmax_xent",
                                             aux_loss_weight=0.01)(params, batch, rngs)
  layers = [k for k in metrics if k.startswith("moe/") and k.endswith("/z_loss")]
  assert len(layers) == 2
  z = sum(float(metrics[k]) for k in layers)
  assert float(metrics["train/z_loss"]) == pytest.approx(0.5 * z, rel=1e-6)
  assert float(total) == pytest.approx(float(metrics["train/cls_loss"]) + 0.01 * float(
      metrics["train/aux_loss"]) + 0.5 * z, rel=1e-6)
  base_total, base_metrics = objectives.classification(base, loss="softmax_xent",
                                                       aux_loss_weight=0.01)(params, batch, rngs)
  assert not [k for k in base_metrics if "z_loss" in k]
  assert float(total) == pytest.approx(float(base_total) + 0.5 * z, rel=1e-6)


class _OwnLossRouter(NoisyTopKRouter):
  """A plug-in's router with a loss of its own, `spread_loss` (twice its importance loss), handed
  over with weight 0.3: neither the model nor the objective knows its name."""

  def __call__(self, x, *, train: bool):
    plan, metrics = super().__call__(x, train=train)
    return plan, {**metrics, "spread_loss": 2.0 * metrics["importance_loss"],
                  routers.LOSSES: {"spread_loss": 0.3}}


class _OwnLoss(TokenChoice):
  name = "own_loss_test"
  module = _OwnLossRouter


def test_a_routers_own_loss_is_weighted_summed_added_and_logged(monkeypatch):
  builtins.register()
  # The family by name for this test only: registering it for good would add it to the valid
  # names other tests' messages list.
  monkeypatch.setitem(registries.ROUTERS._entries, _OwnLoss.name, _OwnLoss)
  config = from_dict(ModelConfig, dict(_TINY, router=dict(type="token_choice", k=2)))
  config.router.type = _OwnLoss.name
  model = build_model(config, 3)
  params, batch, rngs = _inputs_of(model)
  total, metrics = objectives.classification(model, loss="softmax_xent",
                                             aux_loss_weight=0.01)(params, batch, rngs)
  per_layer = [float(metrics[f"moe/layer_{i}/spread_loss"]) for i in (0, 1)]
  assert per_layer == pytest.approx(
      [2 * float(metrics[f"moe/layer_{i}/importance_loss"]) for i in (0, 1)], rel=1e-6)
  assert float(metrics["train/spread_loss"]) == pytest.approx(0.3 * sum(per_layer), rel=1e-6)
  assert float(total) == pytest.approx(float(metrics["train/cls_loss"]) + 0.01 * float(
      metrics["train/aux_loss"]) + 0.3 * sum(per_layer), rel=1e-6)
  assert not [k for k in metrics if k.endswith("/losses")]  # the record itself is not a metric


@pytest.mark.parametrize("args, said", [
    (["model=softmoe_tiny", "model.router.z_loss_weight=0.001"],
     "model.router.z_loss_weight=0.001 means nothing for model.router.type=soft"),
    (["model=vit_tiny", "model.router.z_loss_weight=0.001"], "model.router.z_loss_weight"),
    (["model=vmoe_tiny", "model.router.z_loss_weight=-1"], "model.router.z_loss_weight"),
])
def test_where_the_z_loss_means_nothing_it_is_refused(args, said, run_cli, tmp_path):
  """Soft MoE (its logits enter two softmaxes, over tokens and over slots, neither the paper's
  per-token distribution over experts), a dense ViT and a negative weight: exit 2, one paragraph,
  no workdir."""
  code, _, err = run_cli("pretrain", *args, f"workdir={tmp_path / 'run'}")
  assert code == 2 and said in err and "Traceback" not in err, err
  assert not (tmp_path / "run").exists()
