"""Auxiliary-loss-free load balancing (model.router.balance=bias; Wang et al. 2024, arXiv
2408.15664; DeepSeek-V3, arXiv 2412.19437) against a NumPy transcription of its equations: a
per-expert bias added to the scores that choose each token's TOP-k, never to the combine weights;
after every train step b_i += u * sign(mean_j load_j - load_i) from the loads of the whole batch
(every routing group; each partition of an ensemble on its own); no gradient and no optimizer
moves the bias, and no auxiliary loss enters the training loss. Also: the default rule for u, the
refusals, fine-tuning's loading, export's settings, and the defaults, unchanged."""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.checkpoints.checkpoint import CheckpointError
from runner.config import from_dict, sections
from runner.config.schema import ModelConfig, RouterConfig
from runner.models import build_model, param_updates_of, transfer
from runner.models.moe import balance
from runner.models.moe.routers.token_choice import (Balance, NoisyTopKRouter, TokenChoice,
                                                    bias_update_rate)
from runner.models.param_updates import apply_param_updates
from runner.train import objectives, optimizers, schedules
from runner.train.state import TrainState, abstract_params
from runner.train.step import make_eval_step, make_train_step

G, S, D, E, K = 4, 12, 5, 6, 2


# --- NumPy transcriptions ------------------------------------------------------------------------

def scores_reference(logits: np.ndarray, gate: str) -> np.ndarray:
  u = np.asarray(logits, np.float64)
  if gate == "softmax":
    e = np.exp(u - u.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
  return 1 / (1 + np.exp(-u))


def biased_topk_reference(logits: np.ndarray, bias: np.ndarray, gate: str, k: int):
  """Per token (Wang et al. eq. 3; DeepSeek-V3 eqs. 15-16 with b_i in the TOP-k only): s the
  softmax or sigmoid scores; the TOP-k of s_i + b_i (ties: lower id first); the weights s_i of
  the chosen experts, for sigmoid normalized to sum to 1. Returns (experts, weights), (..., k)."""
  s = scores_reference(logits, gate)
  experts = np.argsort(-(s + np.asarray(bias, np.float64)), axis=-1, kind="stable")[..., :k]
  chosen = np.take_along_axis(s, experts, axis=-1)
  return experts, (chosen if gate == "softmax" else chosen / chosen.sum(-1, keepdims=True))


def loads_reference(experts: np.ndarray, num_experts: int, partitions: int = 1) -> np.ndarray:
  """load_i: the (token, choice) assignments that chose expert i, before capacity, over every
  routing group; block g chooses among partition g % P's experts (local ids)."""
  loads = np.zeros(num_experts, np.int64)
  per = num_experts // partitions
  for g, block in enumerate(experts):
    for token in block:
      for choice in token:
        loads[(g % partitions) * per + int(choice)] += 1
  return loads


def update_reference(bias: np.ndarray, loads: np.ndarray, rate: float,
                     partitions: int = 1) -> np.ndarray:
  """Wang et al. Algorithm 1: b_i <- b_i + u * sign(mean load - load_i), each partition's own
  mean (an ensemble member balances its own experts)."""
  out = np.asarray(bias, np.float64).copy()
  per = len(out) // partitions
  for p in range(partitions):
    part = loads[p * per:(p + 1) * per].astype(np.float64)
    out[p * per:(p + 1) * per] += rate * np.sign(part.mean() - part)
  return out


def max_violation(loads: np.ndarray) -> float:
  return float((loads.max() - loads.mean()) / loads.mean())


def _update(before, loads, rate, after=None):
  """The train step's update of the biases (balance.bias_param_update) after an optimizer that
  left `after` (default: `before`), from `loads`, the `balance_loads` collection (None: not
  collected)."""
  return apply_param_updates((balance.bias_param_update(rate),), before,
                             before if after is None else after,
                             None if loads is None else {balance.LOADS: loads})


# --- the router ----------------------------------------------------------------------------------

def _inputs(seed=0, groups=G, scale=1.0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(groups, S, D)).astype(np.float32)
  kernel = (scale * rng.normal(size=(D, E))).astype(np.float32)
  bias = (0.3 * rng.normal(size=(E,))).astype(np.float32)
  return x, kernel, bias


def _router_params(kernel, bias):
  return {"dense": {"kernel": jnp.asarray(kernel)}, balance.BIAS: jnp.asarray(bias)}


def _route(module, params, x, *, train, seed=0):
  """(plan, metrics, sown loads or None)."""
  (plan, metrics), sown = jax.jit(lambda p, x: module.apply(
      {"params": p}, x, train=train, rngs={"gating": jax.random.key(seed)},
      mutable=[balance.LOADS]))(params, x)
  loads = sown.get(balance.LOADS, {}).get(balance.BIAS)
  return plan, metrics, loads


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("k", [1, 2])
def test_the_bias_chooses_and_the_unbiased_scores_weigh(gate, k):
  x, kernel, bias = _inputs(1)
  module = NoisyTopKRouter(num_experts=E, k=k, capacity_ratio=E, gate=gate, balance="bias")
  plan, metrics, _ = _route(module, _router_params(kernel, bias), x, train=False)
  logits = x.astype(np.float64) @ kernel
  experts, weights = biased_topk_reference(logits, bias, gate, k)
  np.testing.assert_array_equal(np.asarray(plan.experts), experts)
  assert float(metrics["fraction_dropped_assignments"]) == 0.0  # buffers of E * k tokens' worth
  np.testing.assert_allclose(np.asarray(plan.combine_weights), weights, rtol=1e-5)
  unbiased, _ = biased_topk_reference(logits, np.zeros(E), gate, k)
  assert (experts != unbiased).any()  # the bias changed choices, so the check means something


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_training_sows_the_loads_of_every_group_and_the_rule_moves_the_bias(partitions, noise):
  """The loads (P, E/P) sown in training count every group's TOP-k assignments before capacity
  (here the buffers drop some); the update is the paper's, per partition. With partitions, block
  g is routed by partition g % P's kernel columns and bias."""
  x, kernel, bias = _inputs(2)
  module = NoisyTopKRouter(num_experts=E, k=K, capacity_ratio=0.5, balance="bias",
                           partitions=partitions, noise_std=noise)
  params = _router_params(kernel, bias)
  plan, metrics, loads = _route(module, params, x, train=True, seed=3)
  assert float(metrics["fraction_dropped_assignments"]) > 0
  experts = np.asarray(plan.experts)
  if noise == 0:  # the choices themselves, against the NumPy routing of each block
    per = E // partitions
    for g in range(G):
      cols = slice((g % partitions) * per, (g % partitions + 1) * per)
      want, _ = biased_topk_reference(x[g].astype(np.float64) @ kernel[:, cols], bias[cols],
                                      "softmax", K)
      np.testing.assert_array_equal(experts[g], want)
  (counts,) = loads
  assert counts.shape == (partitions, E // partitions)
  want_loads = loads_reference(experts, E, partitions)
  np.testing.assert_array_equal(np.asarray(counts).reshape(E), want_loads)
  assert want_loads.sum() == G * S * K
  new = _update(params, {balance.BIAS: loads}, 0.01)
  np.testing.assert_allclose(np.asarray(new[balance.BIAS]),
                             update_reference(bias, want_loads, 0.01, partitions), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(new["dense"]["kernel"]), kernel)


def test_an_expert_at_the_mean_load_keeps_its_bias():
  loads = jnp.asarray([[4, 2, 3, 3]])
  got = balance.bias_update(jnp.zeros(4), loads, 0.5)
  np.testing.assert_array_equal(np.asarray(got), [-0.5, 0.5, 0.0, 0.0])


def test_evaluation_sows_nothing():
  x, kernel, bias = _inputs(3)
  _, _, loads = _route(NoisyTopKRouter(num_experts=E, k=K, balance="bias"),
                       _router_params(kernel, bias), x, train=False)
  assert loads is None


def test_no_gradient_reaches_the_bias_and_no_auxiliary_loss_is_left():
  """The bias only chooses: the gradient of anything the router returns (combine weights, the
  losses it reports) is exactly 0 there; the auxiliary loss is 0, the importance and load losses
  are still reported as metrics."""
  x, kernel, bias = _inputs(4)
  module = NoisyTopKRouter(num_experts=E, k=K, balance="bias", gate="sigmoid")

  def loss(params):
    plan, metrics = module.apply({"params": params}, x, train=True,
                                 rngs={"gating": jax.random.key(0)})
    return (jnp.sum(plan.combine_weights ** 2) + metrics["importance_loss"]
            + metrics["load_loss"] + metrics["auxiliary_loss"]), metrics

  grads, metrics = jax.grad(loss, has_aux=True)(_router_params(kernel, bias))
  assert np.all(np.asarray(grads[balance.BIAS]) == 0)
  assert np.abs(np.asarray(grads["dense"]["kernel"])).max() > 0
  assert float(metrics["auxiliary_loss"]) == 0.0
  assert float(metrics["importance_loss"]) > 0 and float(metrics["load_loss"]) > 0
  np.testing.assert_allclose(float(metrics["bias_spread"]), bias.max() - bias.min(), rtol=1e-6)


def test_repeated_updates_even_out_a_skewed_router():
  """A router whose kernel favours expert 0 for every token (the tokens share a component): the
  bias alone (no training) brings MaxVio down, starting with the right signs (the busiest
  expert's bias falls, those below the mean load rise); without updates it stays where it
  was. The sign rule then cycles around the balance, at most a few assignments off."""
  x, kernel, _ = _inputs(5, groups=4)
  x, rate = x + 0.5, 0.005
  kernel[:, 0] += 1.0
  module = NoisyTopKRouter(num_experts=E, k=K, noise_std=0.0, balance="bias")
  route = jax.jit(lambda p: module.apply({"params": p}, x, train=True,
                                         mutable=[balance.LOADS])[1][balance.LOADS])
  params = _router_params(kernel, np.zeros(E, np.float32))
  history = []
  for _ in range(150):
    loads = route(params)
    counts = np.asarray(loads[balance.BIAS][0]).reshape(E)
    history.append(max_violation(counts))
    new = _update(params, loads, rate)
    if len(history) == 1:
      step = np.asarray(new[balance.BIAS])
      assert np.argmax(counts) == 0 and step[0] == pytest.approx(-rate)
      below = np.flatnonzero(counts < counts.mean())
      assert len(below) and np.allclose(step[below], rate)
    params = new
  assert history[0] > 0.75  # expert 0 has 1.75 times the mean load
  assert max(history[-30:]) < 0.5 * history[0]
  assert np.mean(history[-30:]) < 0.35 * history[0]


# --- the train step ------------------------------------------------------------------------------

IMAGE = (8, 8, 3)
CLASSES = 3
_TINY = dict(name="bias_test", image_size=IMAGE[0], patch_size=2, hidden_size=16, num_layers=1,
             mlp_dim=32, num_heads=2, moe=dict(layers=[0], num_experts=4, group_size=2))
# No router noise: the loads are a function of the parameters and the batch.
BIASED = from_dict(ModelConfig, dict(_TINY, router=dict(k=2, noise_std=0.0, balance="bias")))
PLAIN = from_dict(ModelConfig, dict(_TINY, router=dict(k=2, noise_std=0.0)))


def _batch(n=8, seed=0):
  rng = np.random.default_rng(seed)
  return {"image": jnp.asarray(rng.normal(size=(n,) + IMAGE).astype(np.float32)),
          "labels": jnp.asarray(np.eye(CLASSES, dtype=np.float32)[rng.integers(0, CLASSES, n)])}


def _state(model, seed=0, bias_scale=0.0):
  """Random parameters (the head not zero: every parameter learns), the bias at bias_scale * a
  normal draw; AdamW with weight decay and clipping, which would move any parameter they
  reach."""
  shapes, _ = abstract_params(model, IMAGE)
  rng = np.random.default_rng(seed)
  params = jax.tree_util.tree_map_with_path(
      lambda path, s: jnp.asarray((bias_scale if balance.BIAS in jax.tree_util.keystr(path)
                                   else 0.3) * rng.normal(size=s.shape), s.dtype), shapes)
  schedule = schedules.make_schedule("linear", 0.01, total_steps=100, warmup_steps=0)
  tx = optimizers.make_optimizer("adam", schedule, params, weight_decay=0.5, grad_clip_norm=1.0)
  return tx, schedule, TrainState(step=jnp.asarray(0, jnp.int32), params=params,
                                  opt_state=tx.init(params))


def _bias(params) -> np.ndarray:
  return np.asarray(params["block_0"]["moe"]["router"][balance.BIAS])


def _loads(model, params, batch) -> np.ndarray:
  """The whole batch's loads, as the router counts them (noise-free)."""
  _, sown = objectives.apply_for_training(model, params, batch["image"], train=True,
                                          rngs={"gating": jax.random.key(0),
                                                "dropout": jax.random.key(0)},
                                          collections=[balance.LOADS])
  loads = sown[balance.LOADS]
  return np.asarray(loads["block_0"]["moe"]["router"][balance.BIAS][0]).reshape(-1)


@pytest.fixture(scope="module")
def biased():
  model = build_model(BIASED, CLASSES)
  tx, schedule, state = _state(model, bias_scale=0.05)

  def step(rate, accum=1):
    return jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=1.0,
                                   accum_steps=accum,
                                   param_updates=(balance.bias_param_update(rate),)))
  return model, state, step


def test_the_train_step_moves_the_bias_by_the_rule_alone(biased):
  """Two steps at u = 0.01 under AdamW with weight decay 0.5 and clipping: each step the bias is
  the previous one + u * sign(mean load - load) of that step's batch, exactly; the other
  parameters learn."""
  model, state, step = biased
  run = step(0.01)
  for seed in (0, 1):
    batch = _batch(seed=seed)
    want = update_reference(_bias(state.params), _loads(model, state.params, batch), 0.01)
    new, metrics = run(state, batch)
    np.testing.assert_allclose(_bias(new.params), want, rtol=0, atol=1e-7)
    assert balance.LOADS not in metrics
    kernel = new.params["block_0"]["moe"]["router"]["dense"]["kernel"]
    assert np.abs(np.asarray(kernel - state.params["block_0"]["moe"]["router"]["dense"]
                             ["kernel"])).max() > 0
    state = new


def test_a_zero_rate_freezes_the_bias_under_weight_decay(biased):
  model, state, step = biased
  assert np.abs(_bias(state.params)).max() > 0.01  # weight decay would shrink it
  new, _ = step(0.0)(state, _batch())
  np.testing.assert_array_equal(_bias(new.params), _bias(state.params))


def test_gradient_accumulation_sums_the_micro_batches_loads(biased):
  """Two micro-batches: the loads of both (the whole batch) decide the signs, as one step over
  the batch does (the choice before capacity is per token, whatever the grouping)."""
  model, state, step = biased
  batch = _batch(seed=2)
  want = update_reference(_bias(state.params), _loads(model, state.params, batch), 0.01)
  one, _ = step(0.01)(state, batch)
  two, _ = step(0.01, accum=2)(state, batch)
  np.testing.assert_allclose(_bias(two.params), want, rtol=0, atol=1e-7)
  np.testing.assert_array_equal(_bias(two.params), _bias(one.params))


def test_no_auxiliary_loss_enters_the_objective(biased):
  model, state, _ = biased
  objective = functools.partial(objectives.classification(
      model, loss="softmax_xent", aux_loss_weight=1.0), collections=(balance.LOADS,))
  total, metrics = jax.jit(objective)(state.params, _batch(),
                                      {"gating": jax.random.key(0), "dropout": jax.random.key(1)})
  assert float(metrics["train/aux_loss"]) == 0.0
  assert float(total) == float(metrics["train/cls_loss"])
  assert float(metrics["moe/layer_0/importance_loss"]) > 0  # still reported
  assert balance.LOADS in metrics  # for the step to take out


def test_evaluation_leaves_the_parameters_alone(biased):
  model, state, _ = biased
  sums = jax.jit(make_eval_step(model))(state.params, {**_batch(), "_mask": jnp.ones(8)})
  assert not any(balance.BIAS in name for name in sums)  # sums over the batch, no parameters
  _, sown = model.apply({"params": state.params}, _batch()["image"], train=False,
                        mutable=[balance.LOADS])
  assert not sown


def test_bias_balancing_trains_with_a_lower_max_violation_than_none():
  """A tiny training (the same batches, the same initial parameters with a skewed router): at
  u = 0.02 the loads end up more even than with the bias frozen at 0, which balances nothing
  (balance=bias adds no auxiliary loss)."""
  model = build_model(BIASED, CLASSES)
  tx, schedule, state = _state(model, seed=1)
  router = state.params["block_0"]["moe"]["router"]
  skewed = router["dense"]["kernel"].at[:, 0].add(2.0)
  state = state.replace(params={**state.params, "block_0": {**state.params["block_0"], "moe": {
      **state.params["block_0"]["moe"], "router": {**router, "dense": {"kernel": skewed}}}}})
  batches = [_batch(seed=s) for s in range(4)]
  violation = {}
  for rate in (0.0, 0.02):
    run = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=1.0,
                                  param_updates=(balance.bias_param_update(rate),)))
    s, history = state, []
    for i in range(40):
      s, metrics = run(s, batches[i % 4])
      history.append(float(metrics["moe/layer_0/max_violation"]))
    violation[rate] = np.mean(history[-10:])
    assert (rate == 0) == (float(metrics["moe/layer_0/bias_spread"]) == 0)
  assert violation[0.02] < 0.5 * violation[0.0], violation


@pytest.mark.parametrize("locked", [False, True])
def test_a_contrastive_image_tower_moves_its_bias_unless_locked(locked):
  """objective=contrastive: the image tower's routers move their bias as a classifier's do; a
  tower locked for LiT runs in inference mode, routes no training tokens and keeps its bias."""
  from runner.config.schema import ObjectiveConfig, TextConfig
  from runner.models.contrastive import build_two_towers
  text = TextConfig(width=8, depth=1, mlp_dim=16, num_heads=2, max_length=6)
  objective = ObjectiveConfig(name="contrastive", embedding_dim=8)
  model = build_two_towers(BIASED, text, objective, vocab_size=11, lock_image=locked)
  batch = {"image": _batch()["image"],
           "tokens": jnp.asarray(np.random.default_rng(0).integers(1, 11, (8, 6)), jnp.int32)}
  params = nn.meta.unbox(jax.jit(lambda i, t: model.init(jax.random.key(0), i, t, train=False))(
      batch["image"], batch["tokens"])["params"])
  schedule = schedules.make_schedule("linear", 0.01, total_steps=10, warmup_steps=0)
  tx = optimizers.make_optimizer("adam", schedule, params, frozen="image/.*" if locked else None)
  state = TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params))
  step = make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=1.0,
                         param_updates=(balance.bias_param_update(0.01),),
                         objective=objectives.contrastive_pairs(
                             model, loss="softmax", aux_loss_weight=1.0))
  new, _ = jax.jit(step)(state, batch)
  bias = np.asarray(new.params["image"]["block_0"]["moe"]["router"][balance.BIAS])
  if locked:
    np.testing.assert_array_equal(bias, np.zeros(4))
  else:
    want = update_reference(np.zeros(4), _loads(model.image, params["image"], batch), 0.01)
    np.testing.assert_allclose(bias, want, rtol=0, atol=1e-7)
    assert np.abs(bias).max() > 0


# --- configuration -------------------------------------------------------------------------------

def _router(**keys) -> ModelConfig:
  return dataclasses.replace(PLAIN, router=dataclasses.replace(PLAIN.router, **keys))


def test_the_update_rate_by_stage():
  """null: the paper's 0.001 in pretraining, 0 (frozen) in fine-tuning; a number as given;
  nothing to move without the bias. The model's updates (what the loop gives the train step):
  the bias', with no rule (frozen) at a rate of 0; none without the bias."""
  bias = _router(balance=Balance.bias)
  assert bias_update_rate(bias.router, "pretrain") == 0.001
  assert bias_update_rate(bias.router, "finetune") == 0.0
  given = _router(balance=Balance.bias, bias_update_rate=0.02)
  assert bias_update_rate(given.router, "pretrain") == bias_update_rate(
      given.router, "finetune") == 0.02
  assert bias_update_rate(PLAIN.router, "pretrain") == 0.0
  dense = dataclasses.replace(BIASED, moe=dataclasses.replace(BIASED.moe, layers=[]))
  assert param_updates_of(dense, "pretrain") == ()
  assert param_updates_of(PLAIN, "pretrain") == ()
  (pretrain,) = param_updates_of(bias, "pretrain")
  assert (pretrain.param, pretrain.collection) == (balance.BIAS, balance.LOADS)
  np.testing.assert_allclose(np.asarray(pretrain.rule(jnp.zeros(2), jnp.asarray([[1, 3]]))),
                             [0.001, -0.001])
  (finetune,) = param_updates_of(bias, "finetune")
  assert finetune.param == balance.BIAS and finetune.rule is None


def test_a_rate_without_the_bias_is_refused():
  problem = TokenChoice.problem(_router(bias_update_rate=0.01))
  assert "model.router.bias_update_rate=0.01 means nothing with model.router.balance=aux_loss" \
      in problem and "model.router.balance=bias" in problem
  assert TokenChoice.problem(_router(balance=Balance.bias, bias_update_rate=0.01)) is None


def test_a_later_stage_keeps_the_checkpoints_balance():
  assert "differs from the checkpoint's bias" in TokenChoice.later_stage_problem(
      {"balance": "bias"}, {"balance": "aux_loss"})
  assert "differs from the checkpoint's aux_loss" in TokenChoice.later_stage_problem(
      {}, {"balance": "bias"})  # a checkpoint from before the key
  assert TokenChoice.later_stage_problem({"balance": "bias"}, {"balance": "bias",
                                                               "k": 1}) is None


def test_the_bias_is_a_replicated_parameter_of_biased_routers_only():
  for config, has in ((BIASED, True), (PLAIN, False)):
    model = build_model(config, CLASSES)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2,) + IMAGE),
                                              train=False))["params"]
    router = boxed["block_0"]["moe"]["router"]
    assert (balance.BIAS in router) == has
    if has:
      assert router[balance.BIAS].names == (None,) and router[balance.BIAS].value.shape == (4,)
  assert "balance" not in TokenChoice.module_kwargs(sections.new(RouterConfig), tokens=S, experts=E)
  assert TokenChoice.module_kwargs(sections.new(RouterConfig, balance=Balance.bias), tokens=S,
                                   experts=E)["balance"] == "bias"


def test_the_default_train_step_is_the_same_program_whatever_the_rate():
  """Without a bias the rate changes nothing: the same jaxpr as with no update at all."""
  model = build_model(PLAIN, CLASSES)
  tx, schedule, state = _state(model)
  assert balance.BIAS not in str(jax.tree_util.tree_structure(state.params))
  programs = [str(jax.make_jaxpr(make_train_step(model, tx, schedule, loss="softmax_xent",
                                                 aux_loss_weight=0.01, param_updates=updates))(
      state, _batch())) for updates in ((), (balance.bias_param_update(0.0),),
                                        (balance.bias_param_update(0.5),))]
  assert programs[0] == programs[1] == programs[2]


def test_fine_tuning_loads_or_starts_the_bias():
  """A checkpoint's bias is copied; one without starts the model's at zeros; a bias the model
  lacks is refused with the key that keeps it."""
  fresh = {"block_1": {"moe": {"router": {"dense": {"kernel": np.zeros((3, 4))},
                                          balance.BIAS: np.zeros(4)}}}}
  stored = {"block_1": {"moe": {"router": {"dense": {"kernel": np.ones((3, 4))},
                                           balance.BIAS: np.arange(4.0)}}}}
  got = transfer.adapt_params(stored, fresh)
  np.testing.assert_array_equal(got["block_1"]["moe"]["router"][balance.BIAS], np.arange(4.0))
  plain = {"block_1": {"moe": {"router": {"dense": {"kernel": np.ones((3, 4))}}}}}
  got = transfer.adapt_params(plain, fresh)
  np.testing.assert_array_equal(got["block_1"]["moe"]["router"][balance.BIAS], np.zeros(4))
  with pytest.raises(CheckpointError, match="set model.router.balance=bias"):
    transfer.adapt_params(stored, plain)


def test_the_routing_analysis_does_not_replan_biased_choices():
  weights = jnp.asarray(np.random.default_rng(0).uniform(size=(2, 4, E)), jnp.float32)
  assert TokenChoice.dropped_at_capacity(sections.new(RouterConfig, balance=Balance.bias), weights, 2) == {}
  assert set(TokenChoice.dropped_at_capacity(sections.new(RouterConfig), weights, 2)) == {"vanilla", "bpr"}


def test_export_writes_the_bias_where_it_is_used():
  plain = TokenChoice.torch_routing(sections.new(RouterConfig), tokens=S, experts=E)
  assert "balance" not in plain.config and set(plain.parameters) == {"dense/kernel"}
  biased = TokenChoice.torch_routing(sections.new(RouterConfig, balance=Balance.bias), tokens=S, experts=E)
  assert biased.config["balance"] == "bias"
  assert biased.parameters[balance.BIAS] == (balance.BIAS, None)


def test_loads_sown_twice_are_summed_and_none_keep_the_bias():
  """A router applied twice in one step (its two calls' loads are one batch's)."""
  params = {"r": {balance.BIAS: jnp.zeros(3)}}
  loads = {"r": {balance.BIAS: (jnp.asarray([[3, 0, 0]]), jnp.asarray([[0, 0, 1]]))}}
  got = _update(params, loads, 1.0)
  np.testing.assert_array_equal(np.asarray(got["r"][balance.BIAS]), [-1.0, 1.0, 1.0])
  # A router that routed nothing in training (LiT's locked tower) keeps its bias; an objective
  # that collected no loads at all is an error.
  kept = _update(params, {}, 1.0, after={"r": {balance.BIAS: jnp.ones(3)}})
  np.testing.assert_array_equal(np.asarray(kept["r"][balance.BIAS]), np.zeros(3))
  with pytest.raises(ValueError, match="'balance_loads' collection, which the objective did "
                     "not return"):
    _update(params, None, 1.0)
