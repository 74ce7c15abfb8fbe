"""Routing analysis (runner/evaluators/routing_analysis.py: the routing analysis of "Scaling
Vision with Sparse Mixture of Experts", Riquelme et al. 2021; docs/routing-analysis.md): synthetic
gates whose answers are known in closed form (U = 1 when the expert is a function of the class,
U = 0 when every token has the same gates, TOP-1 >= TOP-2 and >= 1/E, a warning when H(E) = 0),
the dependence scores against scikit-learn and SciPy, every matrix and scalar the `Hook`
accumulates against a NumPy recomputation from the per-token routing records of tiny
token-choice, experts-choice, Soft MoE and partitioned-ensemble models (padded rows included),
the dropped-patch maps against the routing the model itself does at that capacity, and memory
that does not grow with the number of batches.

Each tiny model (2 blocks, both MoE, 8 experts, 16 px images of 4 px patches) is compiled once
per capacity setting and shared by the tests (`_step`).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from sklearn.metrics import mutual_info_score

from runner.config import sections
from runner.config.schema import EnsembleVariant, RouterConfig
from runner.evaluators import routing_analysis as ra, routing_plots
from runner.models import build_model, model_config
from runner.models.introspection import apply_with_routing
from runner.train.state import abstract_params

CLASSES, BATCH, IMAGES, IMAGE = 5, 8, 5, (16, 16, 3)
SMALL = dict(num_layers=2, hidden_size=32, mlp_dim=64, num_heads=2, image_size=16)
# family -> (catalog name, images per routing group, other model.moe keys); MoE MLPs on both
# blocks. The partitioned batch ensemble (E^3) of 2 members, k = 1, and its two ablations.
MODELS = {"token_choice": ("vmoe_tiny", 4, {}), "experts_choice": ("ecmoe_tiny", 2, {}),
          "soft": ("softmoe_tiny", 1, {}), "pbe": ("vmoe_tiny_k1_m2", 4, {}),
          "tiling_only": ("vmoe_tiny_k1_m2", 4,
                          {"ensemble_variant": EnsembleVariant.tiling_only}),
          "partition_only": ("vmoe_tiny_k1_m2", 4,
                             {"ensemble_variant": EnsembleVariant.partition_only})}
ENSEMBLES = ("pbe", "tiling_only", "partition_only")
LAYERS = ("layer_0", "layer_1")
EDGES = np.linspace(0.0, 1.0, 51)  # bins of 0.02


# --- synthetic gates with known answers ----------------------------------------------------------

def _info(experts: int, tokens: int, *, k: int = 2, class_token: bool = False,
          family: str = "token_choice", members: int = 1) -> ra.LayerInfo:
  patches = tokens - class_token
  side = int(math.isqrt(patches))
  return ra.LayerInfo(family=family, router=sections.new(RouterConfig, k=k), experts=experts, members=members,
                      group_size=1, tokens=tokens, grid=(side, side), class_token=class_token,
                      k=max(k, 2))


def _analyse(weights, labels, *, routed=None, mask=None, k=2, class_token=False) -> dict:
  """`batch_sums` of NumPy records, folded once, then `analyse`."""
  b, t, e = weights.shape
  records = {"expert_weights": weights.astype(np.float32)}
  if routed is not None:
    records["routed_mask"] = routed
  onehot = np.eye(CLASSES + 3, dtype=np.float32)[labels]
  mask = np.ones(b, bool) if mask is None else mask
  patches = slice(1, None) if class_token else slice(0, None)
  sums = ra.batch_sums(records, onehot, mask, max(k, 2), patches)
  totals = {name: np.asarray(v, np.float64) for name, v in sums.items()}
  return ra.analyse(totals, _info(e, t, k=k, class_token=class_token))


def test_expert_a_function_of_the_class_gives_u_one_and_one_hot_rows():
  rng = np.random.default_rng(0)
  experts, tokens, classes = 4, 9, CLASSES + 3  # two classes share each expert (c mod E)
  labels = np.r_[np.arange(classes), rng.integers(0, classes, 40)]
  weights = np.zeros((len(labels), tokens, experts), np.float32)
  weights[np.arange(len(labels)), :, labels % experts] = 1.0
  a = _analyse(weights, labels, routed=weights > 0)
  s = a["scalars"]
  assert s["uncertainty_class"] == pytest.approx(1.0, abs=1e-12)
  assert s["uncertainty_class_routed"] == pytest.approx(1.0, abs=1e-12)
  # I(C; E) = H(E): the expert distribution's entropy, from the label counts.
  counts = np.bincount(labels % experts, minlength=experts)
  assert s["mutual_information_class"] == pytest.approx(scipy.stats.entropy(counts), rel=1e-12)
  np.testing.assert_array_equal(a["arrays"]["class_weights"],
                                np.eye(experts)[np.arange(classes) % experts])
  # Every position sees the same mixture of classes: the expert does not depend on it.
  assert s["uncertainty_position"] == pytest.approx(0.0, abs=1e-12)
  assert s["top1"] == 1.0 and s["top2"] == 0.0
  assert s["dropped_fraction"] == 0.0


@pytest.mark.parametrize("gate", ["uniform", "skewed"])
def test_identical_gates_for_every_token_give_u_zero(gate):
  rng = np.random.default_rng(1)
  experts, tokens, images = 6, 10, 30  # 3x3 patches and a class token
  v = np.full(experts, 1 / experts) if gate == "uniform" else rng.dirichlet(np.ones(experts))
  weights = np.broadcast_to(v.astype(np.float32), (images, tokens, experts)).copy()
  labels = rng.integers(0, CLASSES, images)
  routed = np.zeros_like(weights, bool)
  routed[..., np.argsort(-v, kind="stable")[:2]] = True  # the same TOP-2 for every token
  a = _analyse(weights, labels, routed=routed, class_token=True)
  s = a["scalars"]
  for name in ("uncertainty_class", "uncertainty_position", "mutual_information_class",
               "mutual_information_position", "uncertainty_class_routed",
               "uncertainty_position_routed"):
    assert s[name] == pytest.approx(0.0, abs=1e-9), name
  top = np.sort(v)[::-1]
  assert s["top1"] == pytest.approx(top[0], rel=1e-5)  # float32 sums
  assert s["top2"] == pytest.approx(top[1], rel=1e-5)
  np.testing.assert_allclose(a["arrays"]["position_weights"], np.tile(v, (tokens - 1, 1)),
                             rtol=1e-6)
  # Two experts take every assignment: the load's entropy is log 2 of log 6.
  assert s["load_entropy"] == pytest.approx(math.log(2) / math.log(experts), rel=1e-9)


@pytest.mark.parametrize("concentration", [0.05, 1.0, 1e3])
def test_top1_at_least_top2_and_one_over_e(concentration):
  rng = np.random.default_rng(2)
  experts = 8
  weights = rng.dirichlet(np.full(experts, concentration), size=(20, 5)).astype(np.float32)
  a = _analyse(weights, rng.integers(0, CLASSES, 20))
  s, hist = a["scalars"], a["arrays"]["top_histogram"]
  assert s["top1"] >= s["top2"]
  assert s["top1"] >= 1 / experts - 1e-6
  # Not a single token's TOP-1 lies below 1/E (its bin is the lowest that may hold one).
  assert hist[0, :int(1 / experts / ra.BIN)].sum() == 0
  assert hist.sum(1).tolist() == [100, 100]


def test_one_expert_taking_everything_warns_and_reports_zero():
  weights = np.zeros((4, 4, 3), np.float32)
  weights[..., 0] = 1.0
  with pytest.warns(UserWarning, match="H\\(E\\) = 0"):
    a = _analyse(weights, np.arange(4))
  assert a["scalars"]["uncertainty_class"] == 0.0


# --- dependence against scikit-learn and SciPy ---------------------------------------------------

def _entropies(joint) -> tuple[float, float]:
  """(I, H(E)) from the entropies of the joint and its marginals (SciPy)."""
  joint = np.asarray(joint, np.float64)
  h_a, h_e = scipy.stats.entropy(joint.sum(1)), scipy.stats.entropy(joint.sum(0))
  return h_a + h_e - scipy.stats.entropy(joint.ravel()), h_e


@pytest.mark.parametrize("seed, shape, sparsity", [(0, (10, 8), 0.0), (1, (3, 32), 0.5),
                                                   (2, (16, 4), 0.8), (3, (2, 2), 0.0)])
def test_dependence_matches_sklearn_mutual_information(seed, shape, sparsity):
  rng = np.random.default_rng(seed)
  counts = rng.integers(1, 50, size=shape) * (rng.uniform(size=shape) >= sparsity)
  counts[0, 0] += 1  # never all zero
  mutual, uncertainty, h_e = ra.dependence(counts)
  want = mutual_info_score(None, None, contingency=counts)
  assert mutual == pytest.approx(want, rel=1e-10, abs=1e-13)
  assert h_e == pytest.approx(scipy.stats.entropy(counts.sum(0)), rel=1e-12)
  i, h = _entropies(counts)
  assert mutual == pytest.approx(i, rel=1e-9, abs=1e-12)
  assert uncertainty == pytest.approx(want / h, rel=1e-10, abs=1e-13)
  # Only proportions matter: weights that sum to anything give the same scores.
  scaled = ra.dependence(counts * 0.0137)
  assert scaled == pytest.approx((mutual, uncertainty, h_e), rel=1e-10, abs=1e-13)


def test_dependence_of_nothing_is_zero():
  assert ra.dependence(np.zeros((3, 4))) == (0.0, 0.0, 0.0)


# --- tiny models: every matrix recomputed from the per-token routing records ---------------------

def _config(family: str, **router):
  name, group, moe = MODELS[family]
  c = model_config(name)
  return dataclasses.replace(c, **SMALL, moe=dataclasses.replace(c.moe, layers=[0, 1],
                                                                 group_size=group, **moe),
                             router=dataclasses.replace(c.router, **router))


@functools.cache
def _params(family: str):
  """Random parameters of the model's shapes: routers far from uniform, Soft MoE's logits sharp
  enough that slots do not mix every token alike."""
  shapes, _ = abstract_params(build_model(_config(family), CLASSES), IMAGE)
  rng = np.random.default_rng(len(family))
  params = jax.tree_util.tree_map_with_path(
      lambda path, s: (1.0 if "router" in jax.tree_util.keystr(path) else 0.3)
      * rng.normal(size=s.shape).astype(s.dtype), shapes)
  for block in ("block_0", "block_1"):
    if "scale" in params[block]["moe"]["router"]:
      params[block]["moe"]["router"]["scale"] = np.float32(8.0)
  return jax.tree.map(jnp.asarray, params)


@functools.cache
def _step(family: str, capacity: float | None = None, bpr: bool = False):
  """(info, jitted (params, batch) -> (records, layer metrics, `Hook.sums`)) of the family at an
  inference capacity ratio (None: the model's own), with or without BPR; compiled once."""
  router = {} if capacity is None else {"eval_capacity_ratio": capacity}
  if bpr:
    router["batch_priority"] = True
  config = _config(family, **router)
  model = build_model(config, CLASSES)
  info = ra.layer_info(config, BATCH)
  hook = ra.Hook({"": info}, None, images=IMAGES)

  @jax.jit
  def step(params, batch):
    logits, extras, records = apply_with_routing(model, params, batch["image"], train=False)
    return records, extras["routing"], hook.sums(records, batch, logits)
  return info, step


def _batches(n: int, seed: int = 0, padded: dict | None = None) -> list[dict]:
  """n batches of random images and labels; `padded` {batch: real rows} masks the rest (which
  keep images and labels, so that only the mask can leave them out)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    mask = np.arange(BATCH) < (padded or {}).get(i, BATCH)
    out.append({"image": rng.uniform(-1, 1, (BATCH, *IMAGE)).astype(np.float32),
                "labels": np.eye(CLASSES, dtype=np.float32)[rng.integers(0, CLASSES, BATCH)],
                "_mask": mask})
  return out


BATCHES = _batches(2, padded={1: 5})  # the second batch: 3 padded rows


@functools.cache
def _pass(family: str, capacity: float | None = None, bpr: bool = False):
  """(info, host records, layer metrics, hook) of the family over BATCHES: a hook fed as in an
  eval pass."""
  info, step = _step(family, capacity, bpr)
  hook = ra.Hook({"": info}, None, images=IMAGES)
  records, metrics = [], []
  for batch in BATCHES:
    rec, met, sums = jax.device_get(step(_params(family), batch))
    hook.update(sums, {})
    records.append(rec)
    metrics.append(met)
  return info, records, metrics, hook


def _uncertainty(joint) -> tuple[float, float]:
  i, h_e = _entropies(joint)
  return i, i / h_e


def _reference(records, batches, layer, *, k, class_token, rows=None, cols=None) -> dict:
  """The analysis of one layer in plain NumPy over the real rows of every batch: {name: value},
  names as `analyse` gives them."""
  rows = rows or slice(None)
  cols = cols or slice(None)
  take = lambda name: np.concatenate([r[layer][name][b["_mask"]][:, rows, cols]
                                      for r, b in zip(records, batches)])
  y = np.concatenate([b["labels"][b["_mask"]].argmax(1) for b in batches])
  w = take("expert_weights").astype(np.float64)
  n, t, e = w.shape
  patch = 1 if class_token else 0
  joint = np.stack([w[y == c].sum((0, 1)) for c in range(CLASSES)])
  tokens_of_class = np.array([(y == c).sum() * t for c in range(CLASSES)])
  out = {"class_weights": joint / np.maximum(tokens_of_class, 1)[:, None],
         "position_weights": w[:, patch:].mean(0)}
  out["mutual_information_class"], out["uncertainty_class"] = _uncertainty(joint)
  out["mutual_information_position"], out["uncertainty_position"] = _uncertainty(
      w[:, patch:].sum(0))
  top = -np.sort(-w, axis=-1)[..., :k]
  out["top_histogram"] = np.stack([np.histogram(top[..., i], EDGES)[0] for i in range(k)])
  for i in range(k):
    out[f"top{i + 1}"] = top[..., i].mean()
  if "routed_mask" in records[0][layer]:
    r = take("routed_mask")
    per_token = r.sum(-1)
    processed = np.stack([r[y == c].sum((0, 1)) for c in range(CLASSES)])
    out.update(class_processed=processed, position_processed=r[:, patch:].mean(0),
               load=r.sum((0, 1)) / r.sum(), dropped_fraction=np.mean(per_token == 0),
               experts_per_token=per_token.mean(),
               experts_per_token_position=per_token[:, patch:].mean(0),
               experts_per_token_histogram=np.bincount(per_token.ravel(), minlength=e + 1))
    out["load_entropy"] = scipy.stats.entropy(out["load"]) / math.log(e)
    out["mutual_information_class_routed"], out["uncertainty_class_routed"] = _uncertainty(
        processed)
    out["mutual_information_position_routed"], out["uncertainty_position_routed"] = (
        _uncertainty(r[:, patch:].sum(0)))
  if "dispatch_weights" in records[0][layer]:
    out["slot_position_weights"] = take("dispatch_weights")[:, patch:].mean(0).T
    out["combine_entropy"] = scipy.stats.entropy(take("combine_weights").astype(np.float64),
                                                 axis=-1).mean()
    out["dropped_fraction"] = 0.0
  return out


def _compare(analysed: dict, want: dict) -> None:
  got = {**analysed["scalars"], **analysed["arrays"]}
  assert set(got) - {"top_bins"} == set(want)
  np.testing.assert_allclose(got["top_bins"], EDGES, atol=1e-12)
  for name, value in want.items():
    if name in ("top_histogram", "experts_per_token_histogram", "class_processed"):
      np.testing.assert_array_equal(got[name], value, err_msg=name)  # counts
    else:
      np.testing.assert_allclose(got[name], value, rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("family", ["token_choice", "experts_choice", "soft"])
def test_hook_sums_match_numpy_on_the_routing_records(family):
  info, records, metrics, hook = _pass(family)
  assert sorted(hook.totals) == list(LAYERS)
  for layer in LAYERS:
    want = _reference(records, BATCHES, layer, k=2, class_token=info.class_token)
    _compare(ra.analyse(hook.totals[layer], info), want)
    assert hook.totals[layer]["images"] == 8 + 5  # the padded rows are left out
    if family != "soft":
      # The analysis' dropped fraction is the layer's own metric (the first batch has no padding).
      per_token = records[0][layer]["routed_mask"].sum(-1)
      assert np.mean(per_token == 0) == pytest.approx(
          float(metrics[0][layer]["fraction_dropped_tokens"]), abs=1e-6)
  if family == "token_choice":
    s = ra.analyse(hook.totals["layer_0"], info)["scalars"]
    assert s["dropped_fraction"] > 0  # capacity 1.05 with sharp gates drops some tokens
    assert 0 < s["experts_per_token"] < 2
  if family == "soft":  # what the slots of one expert receive, normalised over experts
    d = records[0]["layer_0"]["dispatch_weights"].reshape(BATCH, info.tokens, info.experts, -1)
    share = d.sum(-1) / d.sum((-1, -2))[..., None]
    np.testing.assert_allclose(records[0]["layer_0"]["expert_weights"], share, rtol=1e-5)


@pytest.mark.parametrize("family", ["token_choice", "experts_choice", "soft"])
def test_numpy_records_give_what_the_traced_sums_give(family):
  """`Hook.sums` outside jit on NumPy records (the NumPy branch of `batch_sums`), restricted to
  layer 1, agrees with the NumPy reference too; the sample is then taken from layer 1."""
  info, records, _, _ = _pass(family)
  hook = ra.Hook({"": info}, (1,), images=IMAGES)
  for rec, batch in zip(records, BATCHES):
    hook.update(hook.sums(rec, batch, None), {})
  assert list(hook.totals) == ["layer_1"] and hook.first_layer == "layer_1"
  _compare(ra.analyse(hook.totals["layer_1"], info),
           _reference(records, BATCHES, "layer_1", k=2, class_token=info.class_token))
  np.testing.assert_array_equal(hook.sample["weights"],
                                records[0]["layer_1"]["expert_weights"][:len(hook.sample["image"])])


@pytest.mark.parametrize("family", ["token_choice", "experts_choice", "soft"])
def test_the_sample_holds_whole_routing_groups_of_the_first_layer(family):
  info, records, _, hook = _pass(family)
  group = MODELS[family][1]
  n = len(hook.sample["image"])
  assert n >= IMAGES and n % group == 0 and n - IMAGES < group  # IMAGES rounded up to groups
  np.testing.assert_array_equal(hook.sample["image"], BATCHES[0]["image"][:n])
  np.testing.assert_array_equal(hook.sample["weights"],
                                records[0]["layer_0"]["expert_weights"][:n])


def test_capacity_at_least_the_group_drops_nothing():
  """Token-choice with C = E / k (buffers of the group's tokens) and experts-choice with C = E
  (every expert takes every token): nothing dropped, sum_e N[c, e] = k * tokens of class c."""
  y = np.concatenate([b["labels"][b["_mask"]].argmax(1) for b in BATCHES])
  for family, capacity, k in (("token_choice", 4.0, 2), ("experts_choice", 8.0, 8)):
    info, records, _, hook = _pass(family, capacity)
    tokens = np.bincount(y, minlength=CLASSES) * info.tokens
    for layer in LAYERS:
      a = ra.analyse(hook.totals[layer], info)
      assert a["scalars"]["dropped_fraction"] == 0.0
      np.testing.assert_array_equal(a["arrays"]["class_processed"].sum(1), k * tokens)
      assert a["scalars"]["experts_per_token"] == k
      _compare(a, _reference(records, BATCHES, layer, k=2, class_token=info.class_token))


def test_top1_at_least_top2_on_every_model():
  for family in ("token_choice", "experts_choice", "soft", *ENSEMBLES):
    info, _, _, hook = _pass(family)
    for key, totals in hook.totals.items():
      s = ra.analyse(totals, info)["scalars"]
      experts = info.experts // info.partitions
      assert s["top1"] >= s["top2"] and s["top1"] >= 1 / experts, (family, key)


# --- partitioned batch ensembles -----------------------------------------------------------------

def _member(family: str, j: int, t: int, e: int) -> tuple[slice, slice]:
  """(tokens, experts) of member j in the records: pbe, a member's copy of the image routed in
  its partition; tiling_only, its copy routed among all experts; partition_only, every token
  routed in each partition."""
  rows = slice(None) if family == "partition_only" else slice(j * t, (j + 1) * t)
  cols = slice(None) if family == "tiling_only" else slice(j * e, (j + 1) * e)
  return rows, cols


@pytest.mark.parametrize("family", ENSEMBLES)
def test_member_records_split_tokens_and_experts(family):
  info, records, _, _ = _pass(family)
  m, t = info.members, info.tokens
  e = 8 if family == "tiling_only" else 4
  assert (max(m, info.partitions), t, info.experts) == (2, 17, 8)
  layer = records[0]["layer_0"]
  split = ra.member_records("layer_0", layer, info)
  assert sorted(split) == ["layer_0/member_0", "layer_0/member_1"]
  for j in range(2):
    member = split[f"layer_0/member_{j}"]
    rows, cols = _member(family, j, t, e)
    assert set(member) == {"expert_weights", "expert_mask", "routed_mask"}
    # The member's tokens route among its experts: softmax rows over them, no choices elsewhere
    # (pbe: zero gates elsewhere; partition_only: the other partition's own softmax).
    w = member["expert_weights"]
    assert w.shape == (BATCH, t, e)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
    if family == "pbe":
      full = layer["expert_weights"][:, rows]
      assert np.all(np.delete(full, np.arange(8)[cols], axis=-1) == 0)
    ids = layer["selected_experts"][:, rows]
    if family == "partition_only":  # (images, tokens, M * k): partition j's choice is column j
      ids = ids[..., j:j + 1]
    assert np.all((ids >= np.arange(8)[cols][0]) & (ids <= np.arange(8)[cols][-1]))
    routed = layer["routed_experts"][:, rows]
    routed = routed[..., j:j + 1] if family == "partition_only" else routed
    np.testing.assert_array_equal(member["routed_mask"].any(-1), (routed >= 0).any(-1))
  assert ra.member_records("layer_0", layer, dataclasses.replace(
      info, members=1, partitions=1)) == {"layer_0": layer}


@pytest.mark.parametrize("family", ENSEMBLES)
def test_per_member_matrices_match_numpy_on_the_members_slices(family):
  info, records, _, hook = _pass(family)
  t, e = info.tokens, 8 if family == "tiling_only" else 4
  assert sorted(hook.totals) == [f"{layer}/member_{j}" for layer in LAYERS for j in range(2)]
  for layer in LAYERS:
    for j in range(2):
      rows, cols = _member(family, j, t, e)
      want = _reference(records, BATCHES, layer, k=2, class_token=True, rows=rows, cols=cols)
      key = f"{layer}/member_{j}"
      a = ra.analyse(hook.totals[key], hook._info(key))
      _compare(a, want)
      assert a["scalars"]["experts_per_token"] <= 1  # k = 1 per member


@pytest.mark.parametrize("family", ENSEMBLES)
def test_member_dropped_patches_follow_the_members_routing(family):
  """Member 0's map at a capacity is member 0's routing at that capacity."""
  info, _, _, hook = _pass(family)
  drops = ra.dropped_patches(hook.sample["weights"], info, [0.3])
  assert sorted(drops) == ["0.3/bpr", "0.3/vanilla"]
  _, step = _step(family, 0.3)
  records = jax.device_get(step(_params(family), BATCHES[0]))[0]
  n = len(hook.sample["weights"])
  rows, cols = _member(family, 0, info.tokens, 8 if family == "tiling_only" else 4)
  routed = records["layer_0"]["routed_mask"][:n, rows, cols]
  np.testing.assert_array_equal(drops["0.3/vanilla"], ~routed.any(-1))
  assert drops["0.3/vanilla"].any() and not drops["0.3/vanilla"].all()


# --- dropped-patch maps: the dispatch plan of the model at that capacity -------------------------

@pytest.mark.parametrize("family, capacity, bpr", [
    ("token_choice", None, False),  # the model's own capacity ratio, 1.05
    ("token_choice", 0.3, False), ("token_choice", 0.3, True), ("token_choice", 1.0, True),
    ("token_choice", 4.0, False),
    ("experts_choice", None, False), ("experts_choice", 0.3, False),
    ("experts_choice", 8.0, False),
])
def test_dropped_patches_equal_the_models_routing_at_that_capacity(family, capacity, bpr):
  info, _, _, hook = _pass(family)
  ratio = capacity or info.router.capacity_ratio
  drops = ra.dropped_patches(hook.sample["weights"], info, [ratio])
  routings = ["vanilla", "bpr"] if family == "token_choice" else ["vanilla"]
  assert sorted(drops) == sorted(f"{ratio:g}/{r}" for r in routings)
  _, step = _step(family, capacity, bpr)
  records = jax.device_get(step(_params(family), BATCHES[0]))[0]
  n = len(hook.sample["weights"])
  unprocessed = ~records["layer_0"]["routed_mask"][:n].any(-1)  # (images, tokens)
  got = drops[f"{ratio:g}/{'bpr' if bpr else 'vanilla'}"]
  assert got.shape == (n, info.tokens) and got.dtype == bool
  np.testing.assert_array_equal(got, unprocessed)
  if ratio >= 4.0:
    assert not got.any()
  if ratio == 0.3:
    assert got.mean() > 0.3  # a low capacity drops many patches


def test_bpr_keeps_other_patches_than_vanilla_at_low_capacity():
  info, _, _, hook = _pass("token_choice")
  drops = ra.dropped_patches(hook.sample["weights"], info, [0.3])
  assert (drops["0.3/vanilla"] != drops["0.3/bpr"]).any()
  # BPR keeps the tokens with the largest TOP-1 gate: those it keeps have a larger mean TOP-1.
  top1 = hook.sample["weights"].max(-1)
  assert top1[~drops["0.3/bpr"]].mean() > top1[~drops["0.3/vanilla"]].mean()


def test_soft_moe_drops_nothing():
  info, _, _, hook = _pass("soft")
  assert ra.dropped_patches(hook.sample["weights"], info, [1.0, 0.1]) == {}


# --- pictures ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, pictures", [
    ("token_choice", {"routing/dropped_patches"}),
    ("experts_choice", {"routing/dropped_patches", "routing/experts_per_token"}),
    ("soft", {"routing/soft_slots"}),
])
def test_the_pictures_follow_the_families_views(family, pictures, tmp_path):
  info, _, _, hook = _pass(family)
  analysed = {key: ra.analyse(totals, info) for key, totals in hook.totals.items()}
  drops = ra.dropped_patches(hook.sample["weights"], info, [0.5, 1.0])
  infos = {key: info for key in analysed}  # the sample's layer, layer_0, among them
  out = routing_plots.draw_all(analysed, drops, hook.sample, tmp_path, images=2,
                               first_layer="layer_0", infos=infos)
  assert set(out) == {"routing/classes", "routing/positions", "routing/top_weights", *pictures}
  assert all(pathlib.Path(path).stat().st_size > 0 for path in out.values())


def test_the_pictures_do_not_import_the_analysis():
  """The analysis draws with routing_plots, which reads only what it is handed: no cycle."""
  tree = ast.parse(inspect.getsource(routing_plots))
  imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
              for alias in node.names}
  imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
  assert not any(name and name.startswith("runner") for name in imported)


# --- streaming -----------------------------------------------------------------------------------

def _nbytes(hook: ra.Hook) -> int:
  arrays = [v for totals in hook.totals.values() for v in totals.values()]
  arrays += list((hook.sample or {}).values())
  return sum(np.asarray(a).nbytes for a in arrays)


def test_memory_does_not_grow_with_the_examples():
  info, step = _step("token_choice")
  hook = ra.Hook({"": info}, None, images=IMAGES)
  batches = _batches(10, seed=3, padded={9: 2})
  sizes = []
  for batch in batches:
    hook.update(jax.device_get(step(_params("token_choice"), batch)[2]), {})
    sizes.append(_nbytes(hook))
  assert sizes[0] == sizes[-1] and len(set(sizes)) == 1
  assert hook.totals["layer_0"]["images"] == 9 * BATCH + 2
  # The sample stays the first batch's.
  sample = hook.sample["image"]
  np.testing.assert_array_equal(sample, batches[0]["image"][:len(sample)])
