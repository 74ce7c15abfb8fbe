"""L∞ PGD evaluator: the constraint set, the attack's effect, routing change against a NumPy IoU
on the captured experts, padding, and the sow of selected experts leaving the outputs alone.

One tiny V-MoE (MoE MLPs on blocks 0 and 2 of 3, routing groups of 2 images) and one tiny ViT,
each compiled for few batch shapes and shared by the tests.
"""
from __future__ import annotations

import copy

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from runner.evaluators.adversarial import (AdversarialEvaluator, _change, make_pgd_attack,
                                           plot_pgd)
from runner.losses.classification import softmax_xent
from runner.models.introspection import routing_records
from runner.models.vit import VisionTransformer
from runner.train.state import abstract_params

CLASSES, IMAGE, BATCH, K = 5, (8, 8, 3), 8, 2
TINY = dict(num_classes=CLASSES, patch_size=4, hidden_size=16, num_layers=3, mlp_dim=32,
            num_heads=2)
VMOE = VisionTransformer(**TINY, moe_layers=(0, 2), moe=dict(
    num_experts=4, group_size=2, router=dict(k=K)))
VIT = VisionTransformer(**TINY)
EPS, EPS_KEY = 0.05, "eps_0.05"


def selected_experts(intermediates, name: str = "selected_experts") -> dict:
  """{"layer_<i>": value} of the record `name` every MoE layer sowed."""
  return {layer: records[name] for layer, records in routing_records(intermediates).items()
          if name in records}


def _id_sets(clean, adversarial):
  """|A ∩ B| and |A ∪ B| of (batch, tokens, k) expert ids, -1 for none."""
  kept_clean, kept_adv = clean >= 0, adversarial >= 0
  match = (clean[..., :, None] == adversarial[..., None, :]) & kept_clean[..., :, None]
  intersection = jnp.sum(jnp.any(match, axis=-1), axis=-1)
  return intersection, jnp.sum(kept_clean, -1) + jnp.sum(kept_adv, -1) - intersection


def routing_change(clean, adversarial):
  """(batch,) 1 − IoU of each token's expert id sets, averaged over tokens (the default rule)."""
  return _change(*_id_sets(clean, adversarial), reference=False)


def routing_change_routed(clean, adversarial):
  """(batch,) the reference code's rule on the ids of the experts that processed each token."""
  return _change(*_id_sets(clean, adversarial), reference=True)


def _params(model, seed=1):
  """Random parameters of the model's shapes, without compiling its initialiser (as in
  test_train_step). Unlike the real init, the head is not zero (which would give no input
  gradient) and the router's gates are far from uniform."""
  shapes, _ = abstract_params(model, IMAGE)
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: 0.3 * rng.normal(size=s.shape).astype(s.dtype), shapes)
  params["head"]["kernel"] *= 3.0  # confident predictions whose loss moves with the input
  return jax.tree.map(jnp.asarray, params)


def _data(n, seed=1):
  rng = np.random.default_rng(seed)
  images = rng.uniform(-1, 1, size=(n,) + IMAGE).astype(np.float32)
  images[:, 0, 0, :] = 1.0  # pixels on the border of the valid range
  images[:, 1, 1, :] = -1.0
  labels = np.eye(CLASSES, dtype=np.float32)[rng.integers(0, CLASSES, n)]
  return images, labels


def _predicted_labels(params, images):
  """The model's own clean predictions as labels: clean error 0, and what the attack flips."""
  return np.eye(CLASSES, dtype=np.float32)[np.asarray(_captured(params, images)[0]).argmax(-1)]


def _batches(*batches):
  """A re-iterable dataset of padded batches, like pipeline.eval_batches."""
  stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
  return tf.data.Dataset.from_tensor_slices(stacked)


def _batch(images, labels, mask=None):
  mask = np.ones(len(images), bool) if mask is None else mask
  return {"image": images, "labels": labels, "_mask": mask}


@pytest.fixture(scope="module")
def vmoe_params():
  return _params(VMOE)


@pytest.fixture(scope="module")
def vmoe_evaluator():
  return AdversarialEvaluator(VMOE, epsilons=[0.0, EPS], steps=3, prefix="test",
                              progress=False)


@pytest.fixture(scope="module")
def attack(vmoe_evaluator):
  return vmoe_evaluator.attack  # make_pgd_attack(VMOE, steps=3), compiled once for the module


def test_perturbation_stays_in_the_2eps_ball_and_the_valid_range(vmoe_params, attack):
  images, labels = _data(BATCH)
  for eps in (0.01, 0.1):
    adv = np.asarray(attack(vmoe_params, images, labels, np.float32(eps)))
    change = np.abs(adv - images)
    assert change.max() <= 2 * eps + 1e-6
    assert adv.min() >= -1.0 and adv.max() <= 1.0
    # The radius in model input is 2ε, not ε: 3 steps of 2·2.5ε/3 reach it.
    assert change.max() > 1.5 * eps
  # One compilation for every ε (ε is traced, not static).
  assert attack._cache_size() == 1


def test_step_size_is_configurable(vmoe_params):
  images, labels = _data(BATCH)
  small = make_pgd_attack(VMOE, steps=2, step_size_fn=lambda eps: eps / 4)
  adv = np.asarray(small(vmoe_params, images, labels, np.float32(0.1)))
  # Two steps of ε/4 in [0, 1] units are at most ε = 0.1 in [-1, 1] units.
  np.testing.assert_array_less(np.abs(adv - images), 0.1 + 1e-6)
  assert np.abs(adv - images).max() > 0.09


def test_zero_epsilon_changes_nothing(vmoe_params, attack, vmoe_evaluator):
  images, labels = _data(BATCH)
  np.testing.assert_array_equal(np.asarray(attack(vmoe_params, images, labels, 0.0)), images)
  out = vmoe_evaluator.run(vmoe_params, _batches(_batch(images, labels)))
  assert out["test/pgd/eps_0/changed_predictions"] == 0.0
  assert out["test/pgd/eps_0/error"] == out["test/pgd/clean/error"]
  np.testing.assert_allclose(out["test/pgd/eps_0/loss"], out["test/pgd/clean/loss"], rtol=1e-6)
  for layer in ("layer_0", "layer_2", "mean"):
    assert out[f"test/pgd/eps_0/routing_change/{layer}"] == 0.0


def test_attack_raises_the_loss(vmoe_params, attack):
  images, _ = _data(BATCH)
  labels = _predicted_labels(vmoe_params, images)
  adv = attack(vmoe_params, images, labels, np.float32(EPS))
  loss = lambda x: np.asarray(softmax_xent(_captured(vmoe_params, x)[0], labels))
  clean, attacked = loss(images), loss(adv)
  assert np.all(attacked >= clean - 1e-5), (clean, attacked)
  assert attacked.mean() > clean.mean() + 0.05


def test_keys_and_attack_effects(vmoe_params, vmoe_evaluator, attack):
  images, _ = _data(BATCH)
  labels = _predicted_labels(vmoe_params, images)
  out = vmoe_evaluator.run(vmoe_params, _batches(_batch(images, labels)))
  per_eps = {"error", "loss", "changed_predictions", "routing_change/layer_0",
             "routing_change/layer_2", "routing_change/mean"}
  assert set(out) == {"test/pgd/clean/error", "test/pgd/clean/loss"} | {
      f"test/pgd/{e}/{k}" for e in ("eps_0", EPS_KEY) for k in per_eps}
  adv_logits = _captured(vmoe_params, attack(vmoe_params, images, labels, np.float32(EPS)))[0]
  changed = np.mean(np.asarray(adv_logits).argmax(-1) != labels.argmax(-1))
  assert changed > 0  # the checks below see an attack that worked
  np.testing.assert_allclose(out[f"test/pgd/{EPS_KEY}/changed_predictions"], changed, rtol=1e-6)
  assert out["test/pgd/clean/error"] == 0.0  # labels are the clean predictions
  np.testing.assert_allclose(out[f"test/pgd/{EPS_KEY}/error"], changed, rtol=1e-6)
  assert out[f"test/pgd/{EPS_KEY}/loss"] > out["test/pgd/clean/loss"]
  layers = [out[f"test/pgd/{EPS_KEY}/routing_change/layer_{i}"] for i in (0, 2)]
  assert max(layers) > 0
  np.testing.assert_allclose(out[f"test/pgd/{EPS_KEY}/routing_change/mean"], np.mean(layers),
                             rtol=1e-6)


@jax.jit
def _apply_capturing(params, images):
  """Sown selected experts, and the router logits captured by Flax for an independent top-k."""
  is_router_logits = lambda module, _: isinstance(module, nn.Dense) and module.name == "dense"
  return VMOE.apply({"params": params}, images, mutable=["intermediates"],
                    capture_intermediates=is_router_logits)


def _captured(params, images):
  (logits, _), state = _apply_capturing(params, images)
  return logits, {k: np.asarray(v) for k, v in selected_experts(state["intermediates"]).items()}


def reference_routing_change(clean: np.ndarray, adversarial: np.ndarray) -> float:
  """1 - |A ∩ B| / |A ∪ B| with Python sets, per token; mean over tokens, then over images."""
  per_image = []
  for image_clean, image_adv in zip(clean, adversarial):
    ious = [len(set(a) & set(b)) / len(set(a) | set(b)) for a, b in zip(image_clean, image_adv)]
    per_image.append(1.0 - np.mean(ious))
  return float(np.mean(per_image))


def test_routing_change_matches_numpy_iou_on_captured_experts(vmoe_params, attack,
                                                              vmoe_evaluator):
  images, labels = _data(BATCH)
  adv = np.asarray(attack(vmoe_params, images, labels, np.float32(EPS)))
  _, clean = _captured(vmoe_params, images)
  _, attacked = _captured(vmoe_params, adv)
  assert set(clean) == {"layer_0", "layer_2"}
  out = vmoe_evaluator.run(vmoe_params, _batches(_batch(images, labels)))
  changes = []
  for layer in clean:
    assert clean[layer].shape == (BATCH, 5, K) and clean[layer].dtype == np.int32
    want = reference_routing_change(clean[layer], attacked[layer])
    changes.append(want)
    np.testing.assert_allclose(out[f"test/pgd/{EPS_KEY}/routing_change/{layer}"], want,
                               rtol=1e-5, atol=1e-7)
  assert max(changes) > 0  # the comparison is not between two zeros


def test_routing_change_function_on_hand_cases():
  clean = jnp.array([[[0, 1], [2, 3]], [[0, 1], [0, 1]]])
  adv = jnp.array([[[1, 0], [3, 1]], [[2, 3], [0, 1]]])
  # image 0: {0,1} vs {1,0} -> IoU 1; {2,3} vs {3,1} -> 1/3. image 1: 0 and 1.
  np.testing.assert_allclose(np.asarray(routing_change(clean, adv)),
                             [1 - (1 + 1 / 3) / 2, 1 - (0 + 1) / 2], rtol=1e-6)


def test_selected_experts_are_the_routers_top_k_per_image(vmoe_params):
  """The sown ids against NumPy's top-k of the router logits, regrouped per image."""
  images, _ = _data(BATCH)
  _, state = _apply_capturing(vmoe_params, images)
  got = selected_experts(state["intermediates"])
  for block, layer in (("block_0", "layer_0"), ("block_2", "layer_2")):
    logits = np.asarray(state["intermediates"][block]["moe"]["router"]["dense"]["__call__"][0])
    assert logits.shape == (BATCH // 2, 2 * 5, 4)  # groups of 2 images of 5 tokens
    want = np.argsort(-logits, axis=-1, kind="stable")[..., :K].reshape(BATCH, 5, K)
    np.testing.assert_array_equal(np.asarray(got[layer]), want)


def test_sow_leaves_outputs_unchanged(vmoe_params):
  images, _ = _data(BATCH)
  variables = {"params": vmoe_params}
  rngs = {"gating": jax.random.key(3), "dropout": jax.random.key(4)}

  @jax.jit  # one program for the four applications
  def both(v, x):
    return [(VMOE.apply(v, x, train=train, rngs=rngs),
             VMOE.apply(v, x, train=train, rngs=rngs, mutable=["intermediates"]))
            for train in (False, True)]

  for plain, ((logits, extras), state) in both(variables, images):
    assert set(state["intermediates"]) == {"block_0", "block_2"}
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(logits))
    jax.tree_util.tree_map(np.testing.assert_array_equal, plain[1], extras)


def test_padded_rows_and_max_examples_are_ignored(vmoe_params, vmoe_evaluator):
  # Routing groups are 2 images, so 4 real images followed by 4 padded rows share no group.
  images, labels = _data(2 * BATCH)
  a, c, garbage = slice(0, 4), slice(4, 8), slice(8, 16)
  real = _batch(images[:BATCH], labels[:BATCH])  # 8 real images, no padding
  base = vmoe_evaluator.run(vmoe_params, _batches(real))
  # The same images 4 to a batch, padded with unrelated images and labels, then a padded batch.
  half = np.arange(BATCH) < 4
  padded = _batches(
      _batch(np.concatenate([images[a], images[garbage][:4]]),
             np.concatenate([labels[a], labels[garbage][:4]]), half),
      _batch(np.concatenate([images[c], images[garbage][4:]]),
             np.concatenate([labels[c], labels[garbage][4:]]), half),
      _batch(images[garbage], labels[garbage], np.zeros(BATCH, bool)))
  with_padding = vmoe_evaluator.run(vmoe_params, padded)
  # max_examples=8 of 16 real images: only the first batch counts.
  capped = copy.copy(vmoe_evaluator)  # shares the compiled steps
  capped.max_examples = 8
  first_eight = capped.run(vmoe_params, _batches(real, _batch(images[garbage], labels[garbage])))
  assert set(base) == set(with_padding) == set(first_eight)
  for key, want in base.items():
    np.testing.assert_allclose(with_padding[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(first_eight[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
  # The padded rows would have changed the result had they counted.
  unmasked = vmoe_evaluator.run(vmoe_params, _batches(
      real, _batch(images[garbage], labels[garbage])))
  assert any(not np.isclose(unmasked[k], base[k], rtol=1e-3) for k in base)
  # max_examples inside a batch: the first 4 rows of `real` count, as when the rest is padding.
  capped.max_examples = 4
  np.testing.assert_allclose(
      list(capped.run(vmoe_params, _batches(real)).values()),
      list(vmoe_evaluator.run(vmoe_params, _batches(_batch(images[:BATCH], labels[:BATCH],
                                                           half))).values()), rtol=1e-5)


def test_dense_vit_has_no_routing_keys():
  params = _params(VIT)
  images, labels = _data(BATCH)  # random labels: the loss still rises
  out = AdversarialEvaluator(VIT, epsilons=[EPS], steps=2, prefix="vit", progress=False).run(
      params, _batches(_batch(images, labels)))
  assert set(out) == {"vit/pgd/clean/error", "vit/pgd/clean/loss", f"vit/pgd/{EPS_KEY}/error",
                      f"vit/pgd/{EPS_KEY}/loss", f"vit/pgd/{EPS_KEY}/changed_predictions"}
  assert out[f"vit/pgd/{EPS_KEY}/loss"] > out["vit/pgd/clean/loss"]


def test_plot_pgd_writes_a_png(tmp_path):
  metrics = {"t/pgd/clean/error": 0.1}
  for e, err in ((0.01, 0.3), (0.02, 0.6)):
    metrics.update({f"t/pgd/eps_{e:g}/error": err, f"t/pgd/eps_{e:g}/changed_predictions": err,
                    f"t/pgd/eps_{e:g}/routing_change/layer_1": err / 2,
                    f"t/pgd/eps_{e:g}/routing_change/layer_3": err / 3,
                    f"t/pgd/eps_{e:g}/routing_change/mean": err / 2.5})
  path = plot_pgd(metrics, "t", str(tmp_path / "pgd.png"))
  assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match="no t/pgd/eps_"):
    plot_pgd({"t/pgd/clean/error": 0.1}, "t", str(tmp_path / "none.png"))


# --- protocol="reference": google-research/vmoe, vmoe/projects/adversarial_attacks ------------

# The tiny V-MoE at inference capacity ratio 0.5: 3 slots per expert for the 20 assignments of a
# group (2 images x 5 tokens x k=2, 4 experts), so capacity drops tokens.
VMOE_DROP = VisionTransformer(**TINY, moe_layers=(0, 2), moe=dict(
    num_experts=4, group_size=2, router=dict(k=K, capacity_ratio=0.5)))


@jax.jit
def _drop_model_records(params, images):
  """VMOE_DROP's outputs and sown records, one compiled program per batch shape."""
  return VMOE_DROP.apply({"params": params}, images, mutable=["intermediates"])


def vmoe_stateless_attack_pgd(images, labels, *, max_epsilon, num_updates, apply_fn, loss_fn):
  """A transcription of attacks.py `stateless_attack_pgd` (no rngs: a deterministic model)."""
  delta = max_epsilon / num_updates

  @jax.grad
  def compute_loss_grads(x):
    return jnp.mean(loss_fn(apply_fn(x), labels))

  def update(i, x_c):
    return x_c + delta * jnp.sign(compute_loss_grads(x_c))
  return jax.lax.fori_loop(0, num_updates, update, images)


def vmoe_sum_intersection_over_union(a, b):
  """A NumPy transcription of attacks.py `sum_intersection_over_union`; a, b (batch, tokens, E)."""
  num_tokens = a.shape[1]
  a, b = (a > 0.0).astype(np.float32), (b > 0.0).astype(np.float32)
  inter = np.sum(a * b, axis=-1)
  union = np.sum(a + b, axis=-1) - inter
  iou = np.where(union > 0, inter / np.where(union > 0, union, 1), 0)
  return np.sum(iou) / num_tokens


@jax.jit
def _drop_model_combine_weights(params, images):
  """Logits and, per MoE layer, restore.py `get_combine_weights` of the router's plan:
  (batch, tokens, E) with the gate of every expert that processes the token, else 0."""
  from runner.models.moe.routers.token_choice import NoisyTopKRouter
  (logits, _), state = VMOE_DROP.apply(
      {"params": params}, images, mutable=["intermediates"],
      capture_intermediates=lambda m, _: isinstance(m, NoisyTopKRouter))
  out = {}
  for block in ("block_0", "block_2"):
    plan = state["intermediates"][block]["moe"]["router"]["__call__"][0][0]
    onehot = jax.nn.one_hot(plan.experts, plan.num_experts)  # (G, S, K, E)
    cw = jnp.sum(onehot * plan.combine_weights[..., None], axis=2)  # (G, S, E)
    out["layer_" + block[-1]] = cw.reshape(-1, cw.shape[-1]).reshape(images.shape[0], -1,
                                                                         cw.shape[-1])
  return logits, out


@pytest.fixture(scope="module")
def reference_evaluator():
  return AdversarialEvaluator(VMOE_DROP, epsilons=[0.0, EPS], steps=3, prefix="ref",
                              progress=False, protocol="reference")


def test_reference_attack_is_vmoe_stateless_attack_pgd(vmoe_params, reference_evaluator):
  images, _ = _data(BATCH)
  labels = np.eye(CLASSES, dtype=np.float32)[
      np.asarray(_drop_model_combine_weights(vmoe_params, images)[0]).argmax(-1)]
  ours = np.asarray(reference_evaluator.attack(vmoe_params, images, labels, np.float32(EPS)))
  apply_fn = lambda x: VMOE_DROP.apply({"params": vmoe_params}, x, train=False)[0]  # noqa: E731
  want = np.asarray(jax.jit(lambda x, y: vmoe_stateless_attack_pgd(
      x, y, max_epsilon=2 * EPS, num_updates=3, apply_fn=apply_fn, loss_fn=softmax_xent))(
          images, labels))
  np.testing.assert_array_equal(ours, want)
  change = np.abs(ours - images)
  # Each of the 3 steps moves every pixel with a non-zero gradient by exactly 2ε/3 ([-1, 1] units).
  assert change.max() <= 2 * EPS + 1e-6 and np.isclose(change.max(), 2 * EPS, rtol=1e-5)
  # No clipping to the valid range: pixels that start at ±1 can leave [-1, 1].
  assert ours.max() > 1.0 or ours.min() < -1.0
  # The default protocol's attack differs: 2.5ε/3 per step, clipped.
  default = np.asarray(make_pgd_attack(VMOE_DROP, steps=3)(vmoe_params, images, labels,
                                                           np.float32(EPS)))
  assert not np.array_equal(default, ours)


def test_reference_routing_change_is_vmoe_iou_of_combine_weights(vmoe_params,
                                                                 reference_evaluator):
  images, _ = _data(BATCH)
  labels = np.eye(CLASSES, dtype=np.float32)[
      np.asarray(_drop_model_combine_weights(vmoe_params, images)[0]).argmax(-1)]
  out = reference_evaluator.run(vmoe_params, _batches(_batch(images, labels)))
  adv = np.asarray(reference_evaluator.attack(vmoe_params, images, labels, np.float32(EPS)))
  _, cw_0 = _drop_model_combine_weights(vmoe_params, images)
  _, cw_m = _drop_model_combine_weights(vmoe_params, adv)
  # The default protocol on the same images: TOP-k sets before the capacity drops.
  (_, _), state0 = _drop_model_records(vmoe_params, images)
  (_, _), state_m = _drop_model_records(vmoe_params, adv)
  top_0, top_m = (selected_experts(s["intermediates"]) for s in (state0, state_m))
  dropped = 0
  for layer in ("layer_0", "layer_2"):
    a, b = np.asarray(cw_0[layer]), np.asarray(cw_m[layer])
    assert a.shape == (BATCH, 5, 4)
    dropped += np.sum((a > 0).sum(-1) < K)  # tokens that lost an assignment to the capacity
    want = 1 - vmoe_sum_intersection_over_union(a, b) / BATCH  # lib.py's routing_changes
    np.testing.assert_allclose(out[f"ref/pgd/{EPS_KEY}/routing_change/{layer}"], want,
                               rtol=1e-5, atol=1e-6)
    # At ε = 0 the images are the same; tokens dropped by every expert count IoU 0, as there.
    want_0 = 1 - vmoe_sum_intersection_over_union(a, a) / BATCH
    np.testing.assert_allclose(out[f"ref/pgd/eps_0/routing_change/{layer}"], want_0,
                               rtol=1e-5, atol=1e-6)
    default = reference_routing_change(np.asarray(top_0[layer]), np.asarray(top_m[layer]))
    assert not np.isclose(default, want, atol=1e-4), layer  # a different quantity
  assert dropped > 0  # the capacity drops tokens: the comparison above is not vacuous
  # Prediction and loss metrics are those of the model on the reference-attacked images.
  logits = np.asarray(_drop_model_combine_weights(vmoe_params, adv)[0])
  np.testing.assert_allclose(out[f"ref/pgd/{EPS_KEY}/changed_predictions"],
                             np.mean(logits.argmax(-1) != labels.argmax(-1)), rtol=1e-6)
  np.testing.assert_allclose(out[f"ref/pgd/{EPS_KEY}/loss"],
                             np.mean(np.asarray(softmax_xent(jnp.asarray(logits), labels))),
                             rtol=1e-5)


def test_routed_experts_sow_marks_the_dropped_assignments(vmoe_params):
  images, _ = _data(BATCH)
  (_, _), state = _drop_model_records(vmoe_params, images)
  selected = selected_experts(state["intermediates"])
  routed = selected_experts(state["intermediates"], "routed_experts")
  _, cw = _drop_model_combine_weights(vmoe_params, images)
  for layer in ("layer_0", "layer_2"):
    s, r = np.asarray(selected[layer]), np.asarray(routed[layer])
    assert r.shape == s.shape == (BATCH, 5, K)
    np.testing.assert_array_equal(r[r >= 0], s[r >= 0])  # kept: the TOP-k id
    assert (r == -1).any()
    kept = np.zeros((BATCH, 5, 4), bool)
    for i, t, j in zip(*np.nonzero(r >= 0)):
      kept[i, t, r[i, t, j]] = True
    np.testing.assert_array_equal(kept, np.asarray(cw[layer]) > 0)


def test_reference_routing_change_function_on_hand_cases():
  clean = jnp.array([[[0, 1], [2, -1], [-1, -1]]])
  adv = jnp.array([[[1, -1], [2, 3], [-1, -1]]])
  # {0,1} vs {1}: 1/2; {2} vs {2,3}: 1/2; {} vs {}: IoU 0 (the reference's where(union > 0)).
  np.testing.assert_allclose(np.asarray(routing_change_routed(clean, adv)),
                             [1 - (0.5 + 0.5 + 0) / 3], rtol=1e-6)
  with pytest.raises(ValueError, match="unknown adversarial protocol 'madry'"):
    make_pgd_attack(VMOE, steps=1, protocol="madry")
