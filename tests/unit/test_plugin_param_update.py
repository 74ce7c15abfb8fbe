"""State a plug-in router family updates through `RouterFamily.param_updates` (docs/extending.md):
a router that keeps an exponential moving average of its experts' shares of the batch's
assignments as a parameter, `load_ema`, which the train step sets after the optimizer from the
loads the router sows; the step and the loop name no family. Checked against a NumPy
recomputation from the sown loads, under AdamW with weight decay (which moves the EMA when no
update claims it)."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config import derived, from_dict, registries
from runner.config.schema import ModelConfig
from runner.models import build_model, param_updates_of
from runner.models.moe import routing
from runner.models.moe.routers import RouterFamily
from runner.models.param_updates import ParamUpdate
from runner.train import objectives, optimizers, schedules
from runner.train.state import TrainState, abstract_params
from runner.train.step import make_train_step

DECAY = 0.5
EMA, LOADS = "load_ema", "ema_loads"  # the parameter, and the collection its loads are sown in


class EmaRouter(nn.Module):
  """TOP-k of softmax(Wx), as token-choice without noise; keeps `load_ema` (E,), an exponential
  moving average of each expert's share of the assignments, and sows each training call's
  per-expert counts at its path for the train step (`EmaLoads.param_updates`)."""
  num_experts: int
  k: int = 2
  capacity_ratio: float = 1.0

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool):
    tokens = x.shape[1]
    logits = nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32,
                      param_dtype=jnp.float32, name="dense")(x.astype(jnp.float32))
    ema = self.param(EMA, nn.initializers.constant(1 / self.num_experts), (self.num_experts,),
                     jnp.float32)
    capacity = routing.expert_capacity(tokens, self.num_experts, self.k, self.capacity_ratio)
    plan = routing.plan_dispatch(jax.nn.softmax(logits), k=self.k, capacity=capacity)
    if train:
      self.sow(LOADS, EMA, jax.nn.one_hot(plan.experts, self.num_experts).sum(axis=(0, 1, 2)))
    return plan, {"auxiliary_loss": jnp.zeros((), jnp.float32),
                  "fraction_dropped_tokens": jnp.mean(~plan.kept.any(axis=-1)),
                  "load_ema_max": jnp.max(ema)}


def ema_update(ema: jax.Array, loads: jax.Array) -> jax.Array:
  """The EMA of the shares, from the loads of the whole batch (every call, every micro-batch)."""
  return DECAY * ema + (1 - DECAY) * loads / jnp.sum(loads)


@dataclasses.dataclass
class EmaConfig:
  """Keys token-choice declares too (the schema's RouterConfig has them)."""
  k: int = 2
  capacity_ratio: float = 1.0


class EmaLoads(RouterFamily):
  name = "ema_loads_test"
  module = EmaRouter
  Config = EmaConfig
  summary = "top-k routing that keeps an EMA of its experts' loads"

  @classmethod
  def module_kwargs(cls, router, *, tokens, experts):
    return dict(k=router.k, capacity_ratio=router.capacity_ratio)

  @classmethod
  def capacity(cls, router, tokens, experts, *, train):
    return routing.expert_capacity(tokens, experts, router.k, router.capacity_ratio)

  @classmethod
  def experts_per_token(cls, router, tokens, experts, capacity):
    return float(router.k)

  @classmethod
  def param_updates(cls, router, stage):
    return (ParamUpdate(param=EMA, collection=LOADS, rule=ema_update),)


IMAGE, CLASSES, STEPS = (8, 8, 3), 3, 3


@pytest.fixture
def family(monkeypatch):
  """`EmaLoads`, found by its name for this test only (registering would add it for good)."""
  monkeypatch.setattr(registries.ROUTERS, "_entries",
                      {**registries.ROUTERS._entries, EmaLoads.name: EmaLoads})
  return EmaLoads


def _model_config() -> ModelConfig:
  return from_dict(ModelConfig, dict(
      name="ema_test", image_size=IMAGE[0], patch_size=2, hidden_size=16, num_layers=1,
      mlp_dim=32, num_heads=2, moe=dict(layers=[0], num_experts=4, group_size=2),
      router=dict(type=EmaLoads.name, k=2, capacity_ratio=1.0)))


def _batch(seed: int, n: int = 8) -> dict:
  rng = np.random.default_rng(seed)
  return {"image": jnp.asarray(rng.normal(size=(n,) + IMAGE).astype(np.float32)),
          "labels": jnp.asarray(np.eye(CLASSES, dtype=np.float32)[rng.integers(0, CLASSES, n)])}


def _start(model):
  """Random parameters (the EMA at 1/E), AdamW with weight decay, which moves any parameter it
  reaches."""
  shapes, _ = abstract_params(model, IMAGE)
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda path, s: jnp.full(s.shape, 0.25, s.dtype) if EMA in jax.tree_util.keystr(path)
      else jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype), shapes)
  schedule = schedules.make_schedule("linear", 0.01, total_steps=100, warmup_steps=0)
  tx = optimizers.make_optimizer("adam", schedule, params, weight_decay=0.5, grad_clip_norm=1.0)
  return tx, schedule, TrainState(step=jnp.asarray(0, jnp.int32), params=params,
                                  opt_state=tx.init(params))


def _router(params) -> dict:
  return params["block_0"]["moe"]["router"]


def _sown_loads(model, params, batch) -> np.ndarray:
  """The loads the router sows for `batch` (no noise: a function of the parameters)."""
  _, sown = objectives.apply_for_training(model, params, batch["image"], train=True,
                                          rngs={"dropout": jax.random.key(0)},
                                          collections=[LOADS])
  (loads,) = _router(sown[LOADS])[EMA]  # one call
  return np.asarray(loads, np.float64)


@pytest.mark.parametrize("accum", [1, 2])
def test_the_train_step_keeps_the_plug_ins_ema_by_its_rule_alone(family, accum):
  """After STEPS steps the EMA is DECAY^n * 1/E + the recomputed shares of each step's batch, as
  NumPy computes it from the loads the router sowed (the whole batch's, with two micro-batches);
  the other parameters learn, and without the update weight decay would have moved the EMA."""
  config = _model_config()
  updates = param_updates_of(config, "pretrain")  # as the training loop asks
  assert [(u.param, u.collection) for u in updates] == [(EMA, LOADS)]
  model = build_model(config, CLASSES)
  tx, schedule, state = _start(model)
  run = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.0,
                                accum_steps=accum, param_updates=updates))
  want = np.full(4, 0.25)
  for seed in range(STEPS):
    batch = _batch(seed)
    loads = _sown_loads(model, state.params, batch)
    assert loads.sum() == 8 * derived.tokens_per_image(config) * 2  # every token's two choices
    want = DECAY * want + (1 - DECAY) * loads / loads.sum()
    new, metrics = run(state, batch)
    assert LOADS not in metrics  # taken out by the step
    assert np.abs(np.asarray(_router(new.params)["dense"]["kernel"]
                             - _router(state.params)["dense"]["kernel"])).max() > 0
    state = new
  np.testing.assert_allclose(np.asarray(_router(state.params)[EMA]), want, rtol=1e-6)
  assert np.abs(want - 0.25).max() > 0.01  # the routing is uneven: the EMA moved

  plain = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.0))
  _, _, start = _start(model)
  moved, _ = plain(start, _batch(0))
  assert np.abs(np.asarray(_router(moved.params)[EMA]) - 0.25).max() > 1e-4


def test_a_dense_model_and_the_built_in_defaults_update_nothing(family):
  config = _model_config()
  dense = dataclasses.replace(config, moe=dataclasses.replace(config.moe, layers=[]))
  assert param_updates_of(dense, "pretrain") == ()
  for name in ("token_choice", "experts_choice", "soft"):
    default = from_dict(ModelConfig, dict(
        name="x", image_size=8, patch_size=2, hidden_size=16, num_layers=1, mlp_dim=32,
        num_heads=2, moe=dict(layers=[0], num_experts=4, group_size=2), router=dict(type=name)))
    assert param_updates_of(default, "pretrain") == (), name
