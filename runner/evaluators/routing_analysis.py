"""What routers learn: the V-MoE paper's routing analysis (Section 5, Appendix E) on any checkpoint.

`eval.routing_analysis=true`; the options are `eval.routing.*`. Streamed over the evaluation split:
each batch's routing records (runner/models/introspection.py) are reduced on the device to
fixed-size sums, so memory does not grow with the number of examples. Scalars go to summary.json as
routing/<layer>/..., the matrices to routing_analysis.npz, and the pictures to routing_*.png (and
W&B); docs/routing-analysis.md says what each is and how to read it."""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import List

import jax
import jax.numpy as jnp
import numpy as np

from runner.config import checks, derived
from runner.config.relations import relation
from runner.config.schema import EvalSuiteConfig, RunFields
from runner.evaluators import routing_plots, suite as suite_lib
from runner.models import tokens_per_image
from runner.models.moe import routers

BIN = 0.02
BINS = int(round(1 / BIN))


@dataclasses.dataclass(frozen=True)
class LayerInfo:
  """What the analysis needs to know about the MoE layers of one model (one checkpoint)."""
  family: str  # router family name
  router: object  # the model.router config as the routers route (derived.router)
  experts: int
  members: int  # M of a tiled partitioned batch ensemble, else 1
  group_size: int  # images per routing group
  tokens: int  # tokens per image
  grid: tuple[int, int]  # patches per side
  class_token: bool  # the first token is the class token (not a patch)
  k: int  # top-i weights reported: the router's k, at least 2
  # Blocks of E / partitions experts, one per member (pbe) or per partition (partition_only),
  # each routed alone; 1 for a V-MoE and for tiling_only (one router over all E experts).
  partitions: int = 1
  views: tuple[str, ...] = ()  # the family's extra views (`RouterFamily.analysis_views`)
  registers: int = 0  # register tokens, after the class token and before the patches

  @property
  def first_patch(self) -> int:
    return int(self.class_token) + self.registers


def layer_info(model_config, batch_size: int) -> LayerInfo:
  family = derived.router_family(model_config)
  side = model_config.image_size // model_config.patch_size
  router = derived.router(model_config)  # fine-grained experts: k*m of E*m
  k = router.k if "k" in family.options else 2
  experts, per_router = derived.num_experts(model_config), derived.experts_per_router(model_config)
  return LayerInfo(family=family.name, router=router, experts=experts,
                   members=derived.predictions_per_image(model_config),
                   group_size=min(model_config.moe.group_size, batch_size),
                   tokens=tokens_per_image(model_config), grid=(side, side),
                   class_token=str(model_config.classifier) == "token",
                   k=max(2, min(k, per_router)), partitions=experts // per_router if experts else 1,
                   views=tuple(family.analysis_views), registers=int(model_config.registers))


def member_records(key: str, records: dict, info: LayerInfo) -> dict[str, dict]:
  """The records of one layer split per member of a partitioned batch ensemble ("<key>/member_<m>"):
  a tiled member's own tokens (pbe, tiling_only), restricted to its partition of the experts (pbe;
  partition_only: every token, once per partition); the layer itself otherwise."""
  if info.members == 1 and info.partitions == 1:
    return {key: records}
  t, e = info.tokens, info.experts // info.partitions
  out = {}
  for m in range(max(info.members, info.partitions)):
    rows = slice(m * t, (m + 1) * t) if info.members > 1 else slice(None)
    cols = slice(m * e, (m + 1) * e) if info.partitions > 1 else slice(None)
    out[f"{key}/member_{m}"] = {name: value[:, rows, cols] for name, value in records.items()
                                if name in ("expert_weights", "expert_mask", "routed_mask")}
  return out


def batch_sums(records: dict, labels, mask, k: int, patches: slice,
               views: tuple[str, ...] = ()) -> dict:
  """The fixed-size sums of one batch and one layer (traced, or NumPy for the tests). records:
  `expert_weights` (B, T, E) and, for a discrete router, `routed_mask`; for the "slot_mixing" view
  `dispatch_weights`, `combine_weights` (B, T, E*P). labels (B, C), mask (B,) of real rows; `views`
  the family's (`LayerInfo.views`)."""
  xp = jnp if isinstance(records["expert_weights"], jax.Array) else np
  w = records["expert_weights"].astype(xp.float32)
  b, t, e = w.shape
  real = mask.astype(xp.float32)
  y = labels.astype(xp.float32)
  y = y / xp.maximum(y.sum(-1, keepdims=True), 1e-12) * real[:, None]
  out = {
      "class_weight": xp.einsum("bc,bte->ce", y, w),
      "class_tokens": y.sum(0) * t,
      "position_weight": xp.einsum("b,bte->te", real, w[:, patches]),
      "images": real.sum(),
  }
  top = -xp.sort(-w, axis=-1)[..., :k]  # (B, T, k), largest first
  bins = xp.clip(xp.floor(top / BIN), 0, BINS - 1).astype(xp.int32)
  onehot = (bins[..., None] == xp.arange(BINS)).astype(xp.float32)  # (B, T, k, BINS)
  out["top_hist"] = xp.einsum("b,btkn->kn", real, onehot)
  out["top_sum"] = xp.einsum("b,btk->k", real, top)
  if (routed := records.get("routed_mask")) is not None:
    r = routed.astype(xp.float32)
    per_token = r.sum(-1)  # (B, T) experts processing each token
    out["class_processed"] = xp.einsum("bc,bte->ce", y, r)
    out["position_processed"] = xp.einsum("b,bte->te", real, r[:, patches])
    out["load"] = xp.einsum("b,bte->e", real, r)
    out["dropped"] = xp.einsum("b,bt->", real, (per_token == 0).astype(xp.float32))
    out["experts_per_token"] = xp.einsum("b,bt->t", real, per_token[:, patches])
    counts = (per_token[..., None] == xp.arange(e + 1)).astype(xp.float32)
    out["experts_per_token_hist"] = xp.einsum("b,btn->n", real, counts)
  if "slot_mixing" in views:
    dispatch = records["dispatch_weights"]
    out["slot_position"] = xp.einsum("b,btn->nt", real, dispatch[:, patches].astype(xp.float32))
    c = records["combine_weights"].astype(xp.float32)
    entropy = -(c * xp.log(xp.maximum(c, 1e-30))).sum(-1)  # (B, T)
    out["combine_entropy"] = xp.einsum("b,bt->", real, entropy)
  return out


def dependence(joint: np.ndarray) -> tuple[float, float, float]:
  """(I(A; E), U(E | A) = I / H(E), H(E)) in nats of a non-negative (A, E) matrix proportional
  to a joint distribution."""
  joint = np.asarray(joint, np.float64)
  total = joint.sum()
  if total <= 0:
    return 0.0, 0.0, 0.0
  p = joint / total
  pa, pe = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
  nz = p > 0
  mutual = float(np.sum(p[nz] * np.log(p[nz] / (pa @ pe)[nz])))
  h_e = float(-np.sum(pe[pe > 0] * np.log(pe[pe > 0])))
  if h_e <= 1e-12:
    warnings.warn("one expert takes all the routing weight (H(E) = 0): the dependence score is "
                  "reported as 0", stacklevel=2)
    return max(mutual, 0.0), 0.0, h_e
  return max(mutual, 0.0), min(max(mutual / h_e, 0.0), 1.0), h_e


class Hook:
  """Accumulates `batch_sums` of every analysed layer over a pass; keeps the first batch's first
  routing group for the dropped-patch maps."""

  def __init__(self, infos: dict[str, LayerInfo], layers: tuple[int, ...] | None, images: int = 4):
    self.infos, self.layers = infos, layers
    self.images = images
    self.totals: dict[str, dict[str, np.ndarray]] = {}
    self.sample: dict | None = None
    self.fed = False

  def _info(self, key: str) -> LayerInfo:
    member = key.split("/")[0] if key.startswith("member_") else ""
    return self.infos[member]

  def _wanted(self, key: str) -> bool:
    return self.layers is None or int(key.rsplit("_", 1)[1]) in self.layers

  def sums(self, records, batch, logits):
    out = {}
    wanted = [key for key in records if self._wanted(key)]
    for key in wanted:
      info = self._info(key)
      patches = slice(info.first_patch, None)
      for name, rec in member_records(key, records[key], info).items():
        out[name] = batch_sums(rec, batch["labels"], batch["_mask"], info.k, patches, info.views)
    first = min(wanted, default=None, key=lambda k: (k.split("/")[0], int(k.rsplit("_", 1)[1])))
    if first is not None:  # the first MoE layer of the (first) model: its first routing groups
      group = self._info(first).group_size
      rows = batch["image"].shape[0]
      n = min(rows - rows % group or rows, max(group, -(-self.images // group) * group))
      out["_sample"] = {"weights": records[first]["expert_weights"][:n],
                        "image": batch["image"][:n]}
      self.first_layer = first  # a Python value, known when the step is traced
    return out

  def update(self, host: dict, out: dict) -> None:
    self.fed = True
    for name, sums in host.items():
      if name == "_sample":
        if self.sample is None:
          self.sample = {k: np.asarray(v) for k, v in sums.items()}
        continue
      totals = self.totals.setdefault(name, {})
      for k, v in sums.items():
        totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)


@dataclasses.dataclass
class RoutingAnalysisKeys:
  routing_analysis: bool = False  # the V-MoE paper's Sec. 5 analysis (eval.routing.*)


@dataclasses.dataclass
class RoutingAnalysisConfig:
  """eval.routing.*: the routing analysis' options (eval.routing_analysis=true)."""
  layers: List[int] = checks.key([], checks.Items(checks.at_least(0), unique=True, example="[1,3]"),
                                 "block indices of MoE layers; []: every MoE layer")
  capacities: List[float] = checks.key(
      [1.0, 0.5, 0.25, 0.1], checks.Items(checks.positive(), nonempty=True,
                                          example="[1.0,0.5,0.1]"),
      "capacity ratios of the dropped-patch maps (V-MoE Fig. 5)")
  images: int = checks.key(4, checks.at_least(0), "images drawn in the dropped-patch maps")


@relation
def routing_analysis_needs_experts(run: RunFields):
  eval, models = getattr(run, "eval", None), derived.held_models(run)
  if not isinstance(eval, EvalSuiteConfig) or not eval.routing_analysis or not models:
    return None
  sparse = [m for m in models if derived.num_experts(m)]
  if not sparse:
    names = ", ".join(sorted({m.name for m in models}))
    return (f"eval.routing_analysis=true looks at what routers decide, but {names} has no MoE "
            "layers (a dense ViT); analyse a V-MoE, experts-choice or Soft MoE checkpoint.")
  layers = set(eval.routing.layers)
  for model in sparse:
    moe = derived.moe_layers(model)
    if layers - set(moe):
      return (f"eval.routing.layers={sorted(layers)} names blocks without an MoE layer in model "
              f"{model.name} ({sorted(layers - set(moe))}); its MoE layers are blocks "
              f"{list(moe)} (or eval.routing.layers=[] for all of them).")
  return None


class Evaluator(suite_lib.Evaluator):
  name = "routing_analysis"
  enabling_key = "eval.routing_analysis"
  Keys = RoutingAnalysisKeys
  Config = RoutingAnalysisConfig
  section = "routing"  # its options, eval.routing.*

  @classmethod
  def enabled(cls, config) -> bool:
    return bool(getattr(config, "routing_analysis", False))

  def __init__(self, suite):
    super().__init__(suite)
    configs = suite.model_configs
    samples = suite.mc_samples or 1
    keys = [""] if len(configs) == 1 and samples == 1 else [
        f"member_{j}" for j in range(len(configs) * samples)]
    configs = configs * samples if len(configs) == 1 else configs
    self.infos = {key: layer_info(c, suite.batch_size) for key, c in zip(keys, configs)}
    self._hook = Hook(self.infos, tuple(suite.config.routing.layers) or None,
                      images=suite.config.routing.images)

  def hook(self):
    return self._hook

  def run(self) -> suite_lib.Result:
    s, hook = self.suite, self._hook
    if not hook.fed:
      s.hook_pass(self.name)
    result = suite_lib.Result()
    arrays, analysed = {}, {}
    for key in sorted(hook.totals, key=_key_order):
      a = analysed[key] = analyse(hook.totals[key], hook._info(key))
      result.summary.update({f"routing/{key}/{k}": v for k, v in a["scalars"].items()})
      arrays.update({f"{key}/{k}": v for k, v in a["arrays"].items()})
    drops = {}
    if hook.sample is not None:
      info = hook._info(hook.first_layer)
      drops = dropped_patches(hook.sample["weights"], info, list(s.config.routing.capacities))
      arrays.update({f"{hook.first_layer}/dropped/{k}": v for k, v in drops.items()})
    if jax.process_index() == 0:
      np.savez_compressed(s.path("routing_analysis.npz"), **arrays)
    if s.plots and analysed:
      first_layer = getattr(hook, "first_layer", None)
      infos = {key: hook._info(key) for key in [*analysed, first_layer] if key is not None}
      result.images.update(routing_plots.draw_all(
          analysed, drops, hook.sample, s.out_dir, images=s.config.routing.images,
          first_layer=first_layer, infos=infos))
    return result


def _key_order(key: str):
  parts = key.split("/")
  layer = next(p for p in parts if p.startswith("layer_"))
  return (parts[0] if parts[0].startswith("member_") and parts[0] != layer else "",
          int(layer.split("_")[1]), key)


def analyse(totals: dict, info: LayerInfo) -> dict:
  """The matrices and scalars of one layer from its accumulated sums."""
  class_weight = totals["class_weight"]
  tokens = np.maximum(totals["class_tokens"][:, None], 1e-12)
  images = max(float(totals["images"]), 1.0)
  position = totals["position_weight"] / images
  mutual_c, uncertainty_c, _ = dependence(class_weight)
  mutual_s, uncertainty_s, _ = dependence(totals["position_weight"])
  top_mean = totals["top_sum"] / (images * info.tokens)
  scalars = {"mutual_information_class": mutual_c, "uncertainty_class": uncertainty_c,
             "mutual_information_position": mutual_s, "uncertainty_position": uncertainty_s}
  scalars.update({f"top{i}": float(v) for i, v in enumerate(top_mean, start=1)})
  arrays = {"class_weights": class_weight / tokens, "position_weights": position,
            "top_histogram": totals["top_hist"], "top_bins": np.arange(BINS + 1) * BIN}
  if "load" in totals:
    load = totals["load"] / max(totals["load"].sum(), 1e-12)
    nz = load[load > 0]
    experts = len(load)  # the layer's experts, or a partitioned ensemble member's E / M
    scalars["load_entropy"] = float(-np.sum(nz * np.log(nz)) / math.log(experts)
                                    if experts > 1 else 1.0)
    scalars["dropped_fraction"] = float(totals["dropped"] / (images * info.tokens))
    # The same scores from the assignments actually processed (the discrete routing, not the
    # soft gates, whose near-uniform mass dilutes the dependence).
    for name in ("class", "position"):
      mutual, uncertainty, _ = dependence(totals[f"{name}_processed"])
      scalars[f"mutual_information_{name}_routed"] = mutual
      scalars[f"uncertainty_{name}_routed"] = uncertainty
    arrays.update(class_processed=totals["class_processed"], load=load,
                  position_processed=totals["position_processed"] / images,
                  experts_per_token_position=totals["experts_per_token"] / images,
                  experts_per_token_histogram=totals["experts_per_token_hist"])
    scalars["experts_per_token"] = float(
        np.sum(totals["experts_per_token_hist"] * np.arange(len(totals["experts_per_token_hist"])))
        / max(totals["experts_per_token_hist"].sum(), 1e-12))
  if "slot_mixing" in info.views:
    arrays["slot_position_weights"] = totals["slot_position"] / images
    scalars["combine_entropy"] = float(totals["combine_entropy"] / (images * info.tokens))
    scalars["dropped_fraction"] = 0.0
  return {"scalars": scalars, "arrays": arrays}


# (family, router, capacity) -> the family's replanning of a group's gates at that capacity, jitted:
# one compiled program (per gates' shape), not each of its dozens of operations compiled and run
# on its own, and compiled once per process however often a run evaluates.
_replans: dict = {}


def _replan(family, router, capacity: int):
  key = (family, repr(router), capacity)
  if key not in _replans:
    _replans[key] = jax.jit(lambda gates: family.dropped_at_capacity(router, gates, capacity))
  return _replans[key]


def dropped_patches(weights: np.ndarray, info: LayerInfo, capacities: list[float]) -> dict:
  """{"<C>/<routing>": (images, tokens) bool, True where no expert processes the token}: the
  first routing group replanned by the router family at each capacity ratio (Fig. 5), in each
  routing it can use ("vanilla", "bpr"). {} for a family whose capacity is fixed (Soft MoE drops
  nothing) or that cannot replan."""
  family = routers.family(info.family)
  if not family.capacity_at_inference:
    return {}
  images, t = weights.shape[0], info.tokens
  group = min(info.group_size, images)
  e = info.experts // info.partitions
  groups = images // group
  # Member 0 of an ensemble: its partition's experts, and the tokens routed with its own: its
  # copy of each image, or every member's copy under tiling_only (one router over all E).
  rows = t * info.members if info.partitions == 1 else t
  gates = jnp.asarray(weights[:groups * group, :rows, :e]).reshape(groups, group * rows, e)
  images = groups * group
  out = {}
  for c in capacities:
    router = dataclasses.replace(info.router, eval_capacity_ratio=float(c))
    capacity = family.capacity(router, group * rows, e, train=False)
    for routing, dropped in _replan(family, router, capacity)(gates).items():
      out[f"{c:g}/{routing}"] = np.asarray(dropped).reshape(images, rows)[:, :t]
  return out
