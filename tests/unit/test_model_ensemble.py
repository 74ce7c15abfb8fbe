"""Partitioned batch ensembles (pBE / E³, Allingham et al.): the partitioned router, the tiled
model and its members, the training loss, and loading a V-MoE into a pBE.

The router vector below is the E=4, M=2, K=1 example of google-research/vmoe's
vmoe/nn/ensemble_routing_test.py (test_expert_partitioning_in_forward_deterministic), with its
gates and importance losses hand-computed; the determinism and noise test is adapted from the
same file. The model properties (M = 1 is a
V-MoE, each member is the V-MoE of its partition, tiling only, the loss and the prediction,
loading a V-MoE checkpoint) are those of the paper's pBE and its ablations.

Models are tiny (8x8x3 images, patch 4 -> 4 tokens + class token, hidden 16, 2 blocks, MoE on
block 1). Parameters are random draws of the model's shapes (abstract_params + NumPy), not the
real initialiser: the real head kernel is zero, which would make every member's logits equal and
most comparisons vacuous. Every forward pass is jitted once per (model, mode) and reused.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config import from_dict, relations
from runner.config.schema import ModelConfig
from runner.losses.classification import softmax_xent
from runner.models import build_model, model_config, transfer
from runner.models.ensemble import combine_logits
from runner.models.moe.layer import MoeMlpBlock
from runner.models.moe.routers.token_choice import NoisyTopKRouter
from runner.train import optimizers, schedules
from runner.train.state import TrainState, abstract_params
from runner.train.step import make_train_step

IMAGE = (8, 8, 3)
TOKENS = 5  # 4 patches + the class token
NUM_CLASSES = 5
BATCH = 4
_BASE = dict(name="ensemble_test", image_size=IMAGE[0], patch_size=4, hidden_size=16,
             num_layers=2, mlp_dim=32, num_heads=2)


def config(*, experts=4, members=2, k=1, variant="pbe", group_size=2, capacity=1.05,
           eval_capacity=4.0, noise=1.0, expert_dropout=0.0, batch_priority=False,
           layers=(1,)) -> ModelConfig:
  return from_dict(ModelConfig, dict(
      _BASE, moe=dict(layers=list(layers), num_experts=experts, group_size=group_size,
                      expert_dropout=expert_dropout, ensemble_size=members,
                      ensemble_variant=variant),
      router=dict(k=k, capacity_ratio=capacity, eval_capacity_ratio=eval_capacity,
                  noise_std=noise, batch_priority=batch_priority)))


_MODELS: dict = {}
_FORWARD: dict = {}


def model_of(**kw):
  """One VisionTransformer per config (cached, so jitted forwards are shared between tests)."""
  key = tuple(sorted(kw.items()))
  if key not in _MODELS:
    _MODELS[key] = build_model(config(**kw), NUM_CLASSES)
  return _MODELS[key]


def forward(kw: dict, params, images, *, train=False, dropout=None, rngs=None, mutable=False,
            capture=False):
  """model.apply, jitted once per (config, mode)."""
  model = model_of(**kw)
  rngs = rngs or {}
  key = (tuple(sorted(kw.items())), train, dropout, tuple(sorted(rngs)), bool(mutable), capture)
  if key not in _FORWARD:
    extra = {}
    if mutable:
      extra["mutable"] = ["intermediates"]
    if capture:
      extra["capture_intermediates"] = True
    _FORWARD[key] = jax.jit(lambda p, x, r: model.apply(
        {"params": p}, x, train=train, dropout=dropout, rngs=r, **extra))
  return _FORWARD[key](params, images, rngs)


def random_params(model, seed=0, scale=0.3):
  shapes, _ = abstract_params(model, IMAGE)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(scale * rng.normal(size=s.shape), s.dtype), shapes)


def images_of(n=BATCH, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(n,) + IMAGE), jnp.float32)


def member_params(params, m: int, members: int, experts: int):
  """The V-MoE with the E/M experts and router columns of partition m, all else shared."""
  e = experts // members
  moe = params["block_1"]["moe"]
  sliced = {"router": {"dense": {"kernel": moe["router"]["dense"]["kernel"][:, m * e:(m + 1) * e]}},
            "experts": {name: w[m * e:(m + 1) * e] for name, w in moe["experts"].items()}}
  out = dict(params)
  out["block_1"] = dict(params["block_1"], moe=sliced)
  return out


def selected(state):
  (experts,) = state["intermediates"]["block_1"]["moe"]["selected_experts"]
  return np.asarray(experts)


def _rbg(seed):
  return jax.random.key(seed, impl="rbg")  # compiles much faster than threefry on CPU


# --- the partitioned router: the reference test's E=4, M=2, K=1 example --------------------------

# x: member 0's token [0, 1, 2] in block 0, member 1's token [3, 4, 5] in block 1 (one group).
X5 = jnp.asarray([[[0.0, 1.0, 2.0]], [[3.0, 4.0, 5.0]]], jnp.float32)
W5 = jnp.asarray([[1, 1, -1, -1], [-1, 1, -1, -1], [-1, -1, -1, 1]], jnp.float32)  # (D, E)


def test_partitioned_router_reference_example_deterministic():
  """Gates, choices and importance losses of the E=4, M=2, K=1 example (hand-computed), at eval."""
  variables = {"params": {"dense": {"kernel": W5}}}

  def route(k):
    module = NoisyTopKRouter(num_experts=4, k=k, partitions=2, noise_std=1.0, capacity_ratio=4.0)
    plan, metrics = module.apply(variables, X5, train=False)
    return plan.experts, plan.combine_weights, plan.num_experts, metrics

  def member(m):  # each member is exactly a 2-expert V-MoE router on its own columns
    vmoe = NoisyTopKRouter(num_experts=2, k=1, noise_std=1.0)
    return vmoe.apply({"params": {"dense": {"kernel": W5[:, 2 * m:2 * m + 2]}}}, X5[m:m + 1],
                      train=False)[1]["importance_loss"]

  # k=2 (= E/M) exposes both gates of each partition in the plan, largest first.
  (e1, w1, n1, m1), (e2, w2, n2, m2), imp0, imp1 = jax.jit(
      lambda: (route(1), route(2), member(0), member(1)))()
  assert n1 == n2 == 2  # the plan indexes the E/M experts of the block's partition
  np.testing.assert_array_equal(np.asarray(e1)[:, 0, 0], [1, 1])  # local; global [1, 3]
  np.testing.assert_allclose(np.asarray(w1)[:, 0, 0], [0.880797, 0.999955], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(e2)[:, 0], [[1, 0], [1, 0]])
  np.testing.assert_allclose(np.asarray(w2)[0, 0], [0.880797, 0.119203], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(w2)[1, 0], [0.999955, 4.5398e-5], rtol=1e-4)
  assert float(imp0) == pytest.approx(0.580026, abs=2e-6)
  assert float(imp1) == pytest.approx(0.999818, abs=2e-6)
  for k, metrics in ((1, m1), (2, m2)):
    # Ω_partition: the mean of the members' importance losses (0.580026, 0.999818).
    assert float(metrics["importance_loss"]) == pytest.approx(0.789922, abs=2e-6)
    # At evaluation (no noise) the auxiliary loss is ½ importance, as in the reference code.
    assert float(metrics["auxiliary_loss"]) == pytest.approx(0.5 * 0.789922, abs=2e-6)
    assert "load_loss" not in metrics
    # Each expert's load is reported at its global id: experts 1 and 3 took the tokens.
    load = np.asarray(metrics["expert_load"])
    assert load.shape == (4,)
    assert (load > 0).tolist() == ([False, True, False, True] if k == 1 else [True] * 4)


def test_partitioned_router_reference_example_global_experts_with_and_without_noise():
  """The MoE block (one image whose 2 member copies are the 2 rows, 1 token) reports global
  expert ids: [1, 3] at eval. With noise, member 0 stays in {0, 1} and member 1 in {2, 3}: at
  σ = 0.5 as in google-research/vmoe's ensemble_routing_test.py, and with the router kernel
  scaled down 40x (as σ = 20) so that the noise really flips choices."""
  module = MoeMlpBlock(num_experts=4, mlp_dim=2, group_size=1, ensemble_size=2,
                       router=dict(k=1, capacity_ratio=4.0, noise_std=1.0))
  rng = np.random.default_rng(0)
  shapes = {"fc1_kernel": (4, 3, 2), "fc1_bias": (4, 2), "fc2_kernel": (4, 2, 3),
            "fc2_bias": (4, 3)}
  experts = {n: jnp.asarray(rng.normal(size=s), jnp.float32) for n, s in shapes.items()}

  @jax.jit
  def run(kernel, keys):
    variables = {"params": {"router": {"dense": {"kernel": kernel}}, "experts": experts}}
    (_, metrics), state = module.apply(variables, X5, train=False, mutable=["intermediates"])

    def noisy(key):
      _, state = module.apply(variables, X5, train=True, rngs={"gating": key},
                              mutable=["intermediates"])
      return state["intermediates"]["selected_experts"][0][0, :, 0]
    return state["intermediates"]["selected_experts"][0], metrics, jax.vmap(noisy)(keys)

  keys = jax.random.split(_rbg(7), 64)
  for scale in (1.0, 1 / 40):
    chosen, metrics, picked = run(W5 * scale, keys)
    if scale == 1.0:
      np.testing.assert_array_equal(np.asarray(chosen), [[[1], [3]]])
      assert float(metrics["importance_loss"]) == pytest.approx(0.789922, abs=2e-6)
    picked = np.asarray(picked)  # (seeds, member)
    assert set(picked[:, 0]) <= {0, 1}, picked
    assert set(picked[:, 1]) <= {2, 3}, picked
    if scale < 1:  # the noise really moves the choice, inside the partition only
      assert set(picked[:, 0]) == {0, 1} and set(picked[:, 1]) == {2, 3}


# --- router determinism and noise (adapted from the reference ensemble_routing_test.py) ----------

@pytest.mark.parametrize("groups,members", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_partitioned_router_determinism_and_metric_shapes(groups, members):
  e, k, tokens = 4, 2, 6
  module = NoisyTopKRouter(num_experts=e, k=k, partitions=members, noise_std=1.0)
  variables = {"params": {"dense": {"kernel": jnp.eye(4, dtype=jnp.float32)}}}
  # Block g*M + m: member m of group g (as the MoE layer builds them).
  x = jnp.arange(groups * members * tokens * 4, dtype=jnp.float32).reshape(
      groups * members, tokens, 4) / 10.0
  apply = jax.jit(lambda key, train: module.apply(variables, x, train=train,
                                                  rngs={"gating": key}), static_argnums=1)
  plan_a, m_a = apply(_rbg(1), False)
  plan_b, m_b = apply(_rbg(2), False)
  for a, b in zip(jax.tree.leaves((plan_a, m_a)), jax.tree.leaves((plan_b, m_b))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert set(m_a) == {"importance_loss", "auxiliary_loss", "fraction_dropped_tokens",
                      "fraction_dropped_assignments", "expert_load", "max_violation",
                      "dead_experts", "saturated_experts"}
  assert np.asarray(plan_a.experts).shape == (groups * members, tokens, k)
  assert int(np.asarray(plan_a.experts).max()) < e // members

  plan_c, m_c = apply(_rbg(1), True)
  plan_d, m_d = apply(_rbg(2), True)
  assert {"load_loss"} | set(m_a) == set(m_c)
  for name in m_c:
    assert np.asarray(m_c[name]).shape == ((e,) if name == "expert_load" else ()), name
  # Noise changes the gates and the load loss, never the (clean) importance loss.
  assert not np.allclose(plan_c.combine_weights, plan_d.combine_weights)
  assert float(m_c["load_loss"]) != float(m_d["load_loss"])
  assert float(m_c["importance_loss"]) == float(m_d["importance_loss"]) == float(
      m_a["importance_loss"])


def test_partition_noise_std_is_noise_std_over_experts_per_partition():
  """σ = noise_std / (E/M), as in google-research/vmoe's ensemble router (a V-MoE router of E/M
  experts per member): with both partitions' columns equal, the partitioned router draws the
  same noise (same module path, same logits shape) as a V-MoE router of E/M experts, so gates
  and load loss agree exactly; σ = noise_std / E would change both."""
  a = jnp.asarray(np.random.default_rng(3).normal(size=(3, 2)), jnp.float32)
  x = jnp.asarray(np.random.default_rng(4).normal(size=(4, 6, 3)), jnp.float32)
  pbe = NoisyTopKRouter(num_experts=4, k=1, partitions=2, noise_std=1.0)
  vmoe = NoisyTopKRouter(num_experts=2, k=1, noise_std=1.0)
  both = {"params": {"dense": {"kernel": jnp.concatenate([a, a], 1)}}}
  one = {"params": {"dense": {"kernel": a}}}

  @jax.jit
  def run(key):
    return (pbe.apply(both, x, train=True, rngs={"gating": key}),
            vmoe.apply(one, x, train=True, rngs={"gating": key}),
            pbe.apply(both, x, train=False)[0])
  (plan_p, m_p), (plan_v, m_v), plan_eval = run(_rbg(11))
  np.testing.assert_allclose(plan_p.combine_weights, plan_v.combine_weights, rtol=1e-6)
  np.testing.assert_array_equal(plan_p.experts, plan_v.experts)
  assert float(m_p["load_loss"]) == pytest.approx(float(m_v["load_loss"]), rel=1e-6)
  # ... and the partitioned router is not simply noise-free.
  assert not np.allclose(plan_eval.combine_weights, plan_p.combine_weights)


# --- M = 1 is a V-MoE ----------------------------------------------------------------------------

def _shrunk(name):
  c = model_config(name)
  return dataclasses.replace(c, image_size=IMAGE[0], hidden_size=16, num_layers=2, mlp_dim=32,
                             num_heads=2)


def _init(model, seed):
  """The real initialiser's parameters (unsafe_rbg keys: threefry compilation costs seconds)."""
  k = lambda s: jax.random.key(s, impl="unsafe_rbg")
  v = model.init({"params": k(seed), "gating": k(seed + 1), "dropout": k(seed + 2)},
                 jnp.zeros((1,) + IMAGE, jnp.float32), train=False)
  return nn.meta.unbox(v["params"])


def test_ensemble_size_one_is_the_vmoe_bit_for_bit():
  catalog = _shrunk("vmoe_tiny")
  assert catalog.moe.ensemble_size == 1 and catalog.moe.layers == "every2"
  explicit = from_dict(ModelConfig, dict(
      _BASE, moe=dict(layers="every2", num_experts=catalog.moe.num_experts, ensemble_size=1,
                      ensemble_variant="pbe"), router=dict(k=catalog.router.k)))
  named = _shrunk("vmoe_tiny_m1")
  vmoe, ens1, ens1_named = (build_model(c, NUM_CLASSES) for c in (catalog, explicit, named))
  assert ens1 == vmoe and ens1_named == vmoe and ens1.tiles == 1
  params = random_params(vmoe, seed=1)

  @jax.jit  # one compilation for both models
  def run(images):
    return [(_init(model, 3), model.apply({"params": params}, images)) for model in (vmoe, ens1)]
  (p_vmoe, (l_vmoe, x_vmoe)), (p_ens, (l_ens, x_ens)) = run(images_of())
  assert jax.tree.structure(p_vmoe) == jax.tree.structure(p_ens)
  for a, b in zip(jax.tree.leaves(p_vmoe), jax.tree.leaves(p_ens)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(l_vmoe), np.asarray(l_ens))
  assert "member_logits" not in x_ens and "member_logits" not in x_vmoe
  assert x_ens["pre_logits"].shape == (BATCH, 16)
  np.testing.assert_array_equal(np.asarray(x_vmoe["pre_logits"]), np.asarray(x_ens["pre_logits"]))


# --- each member is the V-MoE of its partition, with the same routing groups ---------------------

@pytest.mark.parametrize("experts,k,eval_capacity,batch_priority", [
    (4, 1, 4.0, False), (8, 2, 4.0, False),
    # Tight capacity: tokens are dropped, so the result also depends on which images share a
    # routing group and in which order (member m's block of group g = its copies of images 2g,
    # 2g+1); still equal to the member's V-MoE with the same group size.
    (4, 2, 0.5, False), (8, 1, 0.5, True)])
def test_each_member_is_the_vmoe_of_its_partition(experts, k, eval_capacity, batch_priority):
  members = 2
  kw = dict(experts=experts, k=k, eval_capacity=eval_capacity, batch_priority=batch_priority)
  params = random_params(model_of(**kw))
  images = images_of(seed=1)
  (logits, extras), state = forward(kw, params, images, mutable=True)
  member_logits = np.asarray(extras["member_logits"])
  assert member_logits.shape == (BATCH, members, NUM_CLASSES)
  pbe_selected = selected(state).reshape(BATCH, members, TOKENS, k)
  vmoe_kw = dict(kw, experts=experts // members, members=1)
  dropped = []
  for m in range(members):
    (v_logits, v_extras), v_state = forward(vmoe_kw, member_params(params, m, members, experts),
                                            images, mutable=True)
    np.testing.assert_allclose(member_logits[:, m], np.asarray(v_logits), atol=1e-5, rtol=1e-5,
                               err_msg=f"member {m}")
    # Same tokens choose the same experts, at their global ids.
    np.testing.assert_array_equal(pbe_selected[:, m],
                                  selected(v_state) + m * (experts // members),
                                  err_msg=f"member {m}")
    dropped.append(float(v_extras["routing"]["layer_1"]["fraction_dropped_tokens"]))
  pbe_dropped = float(extras["routing"]["layer_1"]["fraction_dropped_tokens"])
  assert pbe_dropped == pytest.approx(np.mean(dropped), abs=1e-6)
  if eval_capacity >= 4.0:
    assert pbe_dropped == pytest.approx(0.0, abs=1e-6)
  else:
    assert pbe_dropped > 0.05
  # The members really differ (different experts), so the comparison above is not vacuous.
  assert np.abs(member_logits[:, 0] - member_logits[:, 1]).max() > 1e-3
  np.testing.assert_allclose(np.asarray(logits), np.asarray(combine_logits(member_logits)),
                             atol=1e-6)


# --- selected experts stay in the member's partition ---------------------------------------------

@pytest.mark.parametrize("variant", ["pbe", "partition_only"])
def test_selected_experts_lie_in_the_partition_in_training(variant):
  experts, members, k = 8, 2, 2
  per = experts // members
  kw = dict(experts=experts, k=k, variant=variant, noise=8.0)  # σ = 2: choices spread
  params = random_params(model_of(**kw), seed=2)
  images = images_of(n=8, seed=2)
  (_, extras), state = forward(kw, params, images, train=True,
                               rngs={"gating": jax.random.key(0), "dropout": jax.random.key(1)},
                               mutable=True)
  chosen = selected(state)
  if variant == "pbe":
    assert chosen.shape == (8, members * TOKENS, k)
    by_member = chosen.reshape(8, members, TOKENS, k)
    assert extras["member_logits"].shape == (8, members, NUM_CLASSES)
  else:  # one prediction per image, each token picks k experts in every partition
    assert chosen.shape == (8, TOKENS, members * k)
    by_member = chosen.reshape(8, TOKENS, members, k).transpose(0, 2, 1, 3)
    assert "member_logits" not in extras and extras["pre_logits"].shape == (8, 16)
  for m in range(members):
    ids = by_member[:, m]
    assert ids.min() >= m * per and ids.max() < (m + 1) * per, (m, np.unique(ids))
    assert set(np.unique(ids)) == set(range(m * per, (m + 1) * per))  # not trivially one expert
    # The k choices of a token in a partition are k distinct experts.
    assert (ids[..., 0] != ids[..., 1]).all()
  # The experts that process each token (the adversarial reference protocol's routing change):
  # the same global ids where the assignment was kept, -1 where the capacity dropped it.
  (routed,) = state["intermediates"]["block_1"]["moe"]["routed_experts"]
  routed = np.asarray(routed)
  assert routed.shape == chosen.shape
  assert np.all((routed == chosen) | (routed == -1)) and (routed >= 0).any()


# --- tiling only: identical members at eval ------------------------------------------------------

def test_tiling_only_members_are_identical_at_eval_and_pbe_members_differ():
  kw = dict(experts=4, k=1, variant="tiling_only")
  params = random_params(model_of(**kw))
  images = images_of()
  logits, extras = forward(kw, params, images)
  z = np.asarray(extras["member_logits"])
  assert z.shape == (BATCH, 2, NUM_CLASSES)
  np.testing.assert_array_equal(z[:, 0], z[:, 1])
  logp = jax.nn.log_softmax(z)
  kl = np.sum(np.exp(logp[:, 0]) * (logp[:, 0] - logp[:, 1]), -1)
  np.testing.assert_array_equal(kl, 0.0)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(jax.nn.log_softmax(z[:, 0])),
                             atol=1e-6)
  # The same parameters as a pBE (same tree): different experts, different members.
  pbe_kw = dict(experts=4, k=1)
  _, pbe = forward(pbe_kw, params, images)
  lp = jax.nn.log_softmax(np.asarray(pbe["member_logits"]))
  assert float(np.mean(np.sum(np.exp(lp[:, 0]) * (lp[:, 0] - lp[:, 1]), -1))) > 1e-4


# --- train loss: mean of member CEs; eval: mean of member probabilities --------------------------

def test_train_loss_is_the_mean_member_cross_entropy():
  kw = dict(experts=8, k=2, noise=8.0)  # as in the partition test above: its forward is reused
  batch = 8
  model = model_of(**kw)
  params = random_params(model, seed=4, scale=1.0)  # members far apart
  schedule = schedules.make_schedule("linear", 0.1, total_steps=10, warmup_steps=2)
  tx = optimizers.make_optimizer("sgd", schedule, params, momentum=0.0, grad_clip_norm=None)
  state = TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params))
  seed = 5
  step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.1,
                                 seed=seed))
  rng = np.random.default_rng(5)
  labels = jnp.asarray(np.eye(NUM_CLASSES, dtype=np.float32)[rng.integers(0, NUM_CLASSES, batch)])
  images = images_of(n=batch, seed=5)
  _, metrics = step(state, {"image": images, "labels": labels})
  # The randomness the step draws: split(fold_in(key(seed), step)) -> (gating, dropout).
  gating, dropout = jax.random.split(jax.random.fold_in(jax.random.key(seed), 0))
  (logits, extras), _ = forward(kw, params, images, train=True,
                                rngs={"gating": gating, "dropout": dropout}, mutable=True)
  z = np.asarray(extras["member_logits"], np.float64)
  y = np.asarray(labels)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  member_ce = -(y[:, None, :] * logp).sum(-1)  # (B, M)
  expected = member_ce.mean()
  assert float(metrics["train/cls_loss"]) == pytest.approx(expected, rel=1e-5)
  # Not the cross-entropy of the mean prediction (which Jensen makes smaller).
  ensemble_ce = -(y * np.log(np.exp(logp).mean(1))).sum(-1).mean()
  assert expected - ensemble_ce > 1e-3
  assert float(metrics["train/cls_loss"]) != pytest.approx(ensemble_ce, rel=1e-4)
  assert float(metrics["train/aux_loss"]) == pytest.approx(float(extras["auxiliary_loss"]),
                                                           rel=1e-5)
  assert float(metrics["train/loss"]) == pytest.approx(
      expected + 0.1 * float(extras["auxiliary_loss"]), rel=1e-5)
  # prec@1 is the ensemble's (argmax of the combined logits).
  prec = np.mean(np.argmax(np.asarray(logits), -1) == np.argmax(y, -1))
  assert float(metrics["train/prec@1"]) == pytest.approx(prec)


def test_eval_logits_are_the_log_mean_probability():
  kw = dict(experts=4, k=1)
  params = random_params(model_of(**kw), seed=6)
  logits, extras = forward(kw, params, images_of(seed=6))
  z = np.asarray(extras["member_logits"])
  mean_p = np.asarray(jax.nn.softmax(z)).mean(1)
  np.testing.assert_allclose(np.asarray(jax.nn.softmax(logits)), mean_p, atol=1e-6)
  np.testing.assert_allclose(np.exp(np.asarray(logits)), mean_p, atol=1e-6)  # log p̄ itself
  # The ensemble NLL is -log p̄_y, not the mean member NLL, nor the CE of averaged logits.
  y = np.arange(BATCH) % NUM_CLASSES
  nll = -np.log(mean_p[np.arange(BATCH), y])
  np.testing.assert_allclose(np.asarray(softmax_xent(logits, jnp.eye(NUM_CLASSES)[y])), nll,
                             rtol=1e-5)
  averaged = np.asarray(jax.nn.softmax(z.mean(1)))
  assert np.abs(averaged - mean_p).max() > 1e-4
  # Sigmoid (multi-label) members: logits = logit(mean sigmoid).
  model = build_model(config(**kw), NUM_CLASSES, output="sigmoid")
  s_logits, s_extras = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, images_of(seed=6))
  np.testing.assert_allclose(np.asarray(s_extras["member_logits"]), z, atol=1e-6)
  np.testing.assert_allclose(np.asarray(jax.nn.sigmoid(s_logits)),
                             np.asarray(jax.nn.sigmoid(z)).mean(1), atol=1e-6)


# --- a V-MoE checkpoint loads into a pBE ---------------------------------------------------------

def test_vmoe_params_load_into_a_pbe_with_only_the_head_reinitialised():
  vmoe = build_model(config(experts=4, members=1, k=1), 10)  # upstream: 10 classes
  vmoe_params = random_params(vmoe, seed=7)
  pbe = model_of(experts=4, k=1)
  fresh = jax.jit(lambda: _init(pbe, 0))()
  # Same tree and shapes apart from the head; the router kernel stays (D, E).
  flat_v = {n: np.shape(v) for n, v in transfer.flatten(vmoe_params).items()}
  flat_p = {n: np.shape(v) for n, v in transfer.flatten(fresh).items()}
  assert set(flat_v) == set(flat_p)
  assert {n for n in flat_v if flat_v[n] != flat_p[n]} == {"head/kernel", "head/bias"}
  assert flat_p["block_1/moe/router/dense/kernel"] == (16, 4)
  assert flat_p["block_1/moe/experts/fc1_kernel"] == (4, 16, 32)
  adapted = transfer.adapt_params(vmoe_params, fresh, reinit_head=True)
  old, new, init = (transfer.flatten(t) for t in (vmoe_params, adapted, fresh))
  assert set(new) == set(init)
  for name, value in new.items():
    expected = init[name] if name.startswith("head/") else old[name]
    np.testing.assert_array_equal(np.asarray(value), np.asarray(expected), err_msg=name)
  # The loaded pBE runs, and its members start from different upstream experts.
  _, extras = forward(dict(experts=4, k=1), jax.tree.map(jnp.asarray, adapted), images_of())
  assert extras["member_logits"].shape == (BATCH, 2, NUM_CLASSES)
  # (fresh head is zero-initialised: members differ in their representations)
  pre = np.asarray(extras["pre_logits"]).reshape(BATCH, 2, 16)
  assert np.abs(pre[:, 0] - pre[:, 1]).max() > 1e-3


# --- shapes of every variant, and the config checks ----------------------------------------------

def _small_ensemble(members, layers=(1,), variant="pbe"):
  return from_dict(ModelConfig, dict(
      name="small_ensemble", image_size=4, patch_size=2, hidden_size=8, num_layers=2, mlp_dim=16,
      num_heads=2, classifier="gap",
      moe=dict(layers=list(layers), num_experts=4, group_size=4, ensemble_size=members,
               ensemble_variant=variant),
      router=dict(k=1, capacity_ratio=2.0)))


def test_ensemble_model_shapes():
  shapes = {}
  for members, variant in ((1, "pbe"), (2, "pbe"), (2, "tiling_only"), (2, "partition_only")):
    model = build_model(_small_ensemble(members, variant=variant), 4)
    params, _ = abstract_params(model, (4, 4, 3))
    shapes[members, variant] = {n: v.shape for n, v in transfer.flatten(params).items()}
    images = jax.ShapeDtypeStruct((16, 4, 4, 3), jnp.float32)
    for train in (False, True):
      logits, extras = jax.eval_shape(lambda p, x, model=model, train=train: model.apply(
          {"params": p}, x, train=train, rngs={"gating": jax.random.key(0)}), params, images)
      assert logits.shape == (16, 4)
      if members == 1 or variant == "partition_only":
        assert "member_logits" not in extras
        assert extras["pre_logits"].shape == (16, 8)
      else:
        assert extras["member_logits"].shape == (16, 2, 4)
        assert extras["pre_logits"].shape == (16, 2 * 8)
      assert extras["routing"]["layer_1"]["expert_load"].shape == (4,)
  # All shapes are the V-MoE's, the (D, E) router kernel included.
  for key, tree in shapes.items():
    assert tree == shapes[1, "pbe"], key
  assert shapes[2, "pbe"]["block_1/moe/router/dense/kernel"] == (8, 4)
  # An ensemble without MoE layers, E % M != 0 or k > E/M is rejected by the config checks.
  assert relations.ensemble_needs_experts(_small_ensemble(2, layers=())) is not None
  assert relations.ensemble_needs_experts(_small_ensemble(3)) is not None
  assert relations.ensemble_needs_experts(_small_ensemble(2)) is None
  too_many = dataclasses.replace(_small_ensemble(2), router=dataclasses.replace(_small_ensemble(2).router, k=3))
  assert relations.router_family_rules(too_many) is not None
  assert relations.router_family_rules(_small_ensemble(2, variant="tiling_only")) is None


# --- tiling happens right before the first MoE block ------------------------------------------

def test_tiling_happens_before_the_first_moe_block_only():
  kw, vmoe_kw = dict(experts=4, k=1), dict(experts=4, k=1, members=1)
  params = random_params(model_of(**kw), seed=8)  # the same tree fits the V-MoE with E experts
  images = images_of(seed=8)
  _, pbe = forward(kw, params, images, mutable=True, capture=True)
  _, vmoe = forward(vmoe_kw, params, images, mutable=True, capture=True)
  pbe, vmoe = pbe["intermediates"], vmoe["intermediates"]
  block0 = np.asarray(pbe["block_0"]["__call__"][0][0])
  assert block0.shape == (BATCH, TOKENS, 16)  # block 0 (dense) runs once per image
  np.testing.assert_array_equal(block0, np.asarray(vmoe["block_0"]["__call__"][0][0]))
  assert pbe["block_1"]["attention"]["__call__"][0].shape == (2 * BATCH, TOKENS, 16)
  assert pbe["block_1"]["__call__"][0][0].shape == (2 * BATCH, TOKENS, 16)
  assert pbe["head"]["__call__"][0].shape == (2 * BATCH, NUM_CLASSES)
  # Block 1's input is repeated image-major: row b*M + m is image b, for every member m.
  norm1 = np.asarray(pbe["block_1"]["norm1"]["__call__"][0]).reshape(BATCH, 2, TOKENS, 16)
  v_norm1 = np.asarray(vmoe["block_1"]["norm1"]["__call__"][0])
  for m in range(2):
    np.testing.assert_array_equal(norm1[:, m], v_norm1)


# --- MC-dropout hook ---------------------------------------------------------------------------

def test_dropout_at_inference_samples_expert_dropout():
  kw = dict(experts=4, k=1, expert_dropout=0.5)
  params = random_params(model_of(**kw), seed=9)
  images = images_of(seed=9)
  plain, _ = forward(dict(kw, expert_dropout=0.0), params, images)  # the same model, no dropout
  k1, k2 = jax.random.key(1), jax.random.key(2)
  # dropout=None at eval: the dropout key is not used.
  for key in (k1, k2):
    same, _ = forward(kw, params, images, rngs={"dropout": key})
    np.testing.assert_array_equal(np.asarray(same), np.asarray(plain))
  # dropout=True: a sample per key, reproducible; the router stays deterministic (no gating key).
  a1, x1 = forward(kw, params, images, dropout=True, rngs={"dropout": k1})
  a1b, _ = forward(kw, params, images, dropout=True, rngs={"dropout": k1})
  a2, _ = forward(kw, params, images, dropout=True, rngs={"dropout": k2})
  np.testing.assert_array_equal(np.asarray(a1), np.asarray(a1b))
  assert np.abs(np.asarray(a1) - np.asarray(plain)).max() > 1e-4
  assert np.abs(np.asarray(a1) - np.asarray(a2)).max() > 1e-4
  assert "load_loss" not in x1["routing"]["layer_1"]
