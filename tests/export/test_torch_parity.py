"""The exporter's PyTorch side against the Flax model it exports (runner/export).

Each case builds a tiny vmoe model from a ModelConfig, fills its parameters with random values
(none left at a zero initialisation, so that no part of the model is trivially inert), writes it
with `files.write_model`, imports the written modeling_vmoe.py from the folder, and compares its
`predict_proba` with the Flax model's probabilities at inference to 1e-4: dense ViTs (token,
GAP, MAP with qk-norm, pre-logits), token-choice V-MoEs at an inference capacity that drops
assignments (vanilla routing, Batch Prioritized Routing by max and by sum, the reference's
capacity rounding, one routing group or several), experts-choice, Soft MoE, partitioned batch
ensembles (pbe, tiling_only, partition_only; at the first block too), DeepSeekMoE's shared and
fine-grained experts, auxiliary-loss-free balancing's bias (softmax and sigmoid gates, an
ensemble's partitions), dropless token choice, sigmoid outputs; and
batches of any size (12 and 3 images), whose short last routing group the exported model
completes with zero images as `vmoe eval` completes its last batch.

Heteroscedastic heads sample noise, and JAX's draws cannot be reproduced in PyTorch: the same
draws injected into both (`heads.het_logits` and the head's `mean_logits`) must agree to 1e-4,
and the whole model's probabilities, each a Monte-Carlo mean of S draws, must agree within a
bound on the Monte-Carlo error (see `test_het_models_agree_within_monte_carlo_error`).

Also: every tensor of model.safetensors reaches the output (a gradient for each), the layout
refuses a parameter it cannot place or would place twice, a router family without
`torch_routing` is refused, a plug-in family exports through its own `TorchRouting`, and the
written modeling file imports only torch, safetensors and the standard library (while no module
of vmoe imports torch), and the loading snippets of the model card and docs/export.md run as
written. `make test-export` runs this module (it needs PyTorch).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from PIL import Image  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from runner.config import registries, sections  # noqa: E402
from runner.config.schema import (  # noqa: E402
    Activation, Classifier, EnsembleVariant, HeadConfig, HeadType, ModelConfig, MoeConfig, RouterConfig)
from runner.export import architecture, card, files, layout  # noqa: E402
from runner.models import build_model, heads  # noqa: E402
from runner.models.moe import routing  # noqa: E402
from runner.models.moe.routers import RouterFamily  # noqa: E402
from runner.models.moe.routers.token_choice import CapacityRounding, Priority  # noqa: E402
from runner.models.moe.routers.base import TorchRouting  # noqa: E402
from runner.models.moe.routers.token_choice import Balance, Gate, TokenChoice  # noqa: E402

pytestmark = pytest.mark.xdist_group("export_torch_parity")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
CLASSES = 5
BATCH = 4

BASE = ModelConfig(name="tiny", image_size=16, patch_size=4, hidden_size=32, num_layers=2,
                   mlp_dim=64, num_heads=2)
# Token choice at an inference capacity of half the slots that k * tokens / E would need.
DROPPING = sections.new(RouterConfig, k=2, capacity_ratio=1.0, eval_capacity_ratio=0.5)


def moe(layers=(1,), experts=4, group=2, router=DROPPING, **moe_keys) -> dict:
  return dict(moe=MoeConfig(layers=list(layers), num_experts=experts, group_size=group,
                            **moe_keys), router=router)


def pbe(variant: EnsembleVariant, layers=(1,), **router_keys) -> dict:
  return moe(layers, router=sections.new(RouterConfig, k=1, capacity_ratio=1.0, eval_capacity_ratio=0.5,
                                         **router_keys),
             ensemble_size=2, ensemble_variant=variant)


# name: (ModelConfig keys over BASE, output)
CASES = {
    "vit_token": ({}, "softmax"),
    "vit_gap": (dict(classifier=Classifier.gap), "softmax"),
    "vit_map_qk_norm": (dict(classifier=Classifier.map, attention_qk_norm=True), "softmax"),
    "vit_representation": (dict(representation_size=24), "softmax"),
    "vit_sigmoid": (dict(classifier=Classifier.gap), "sigmoid"),
    # What timm's and transformers' ViTs vary (docs/released-checkpoints.md): registers, layer
    # scale, CLIP's pre-norm, fc_norm after average pooling, their GELUs and LayerNorm epsilons.
    "vit_timm_variants": (dict(classifier=Classifier.gap, fc_norm=True, registers=2,
                               layer_scale=0.1, pre_norm=True, activation=Activation.gelu,
                               layer_norm_eps=1e-5), "softmax"),
    "vit_token_registers_layer_scale": (dict(registers=3, layer_scale=0.5), "softmax"),
    "vit_map_registers_quick_gelu": (dict(classifier=Classifier.map, registers=1,
                                          activation=Activation.quick_gelu,
                                          layer_norm_eps=1e-12, attention_qk_norm=True),
                                     "softmax"),
    # GAP: the prediction reads every token, so which assignments are dropped shows.
    "token_choice_vanilla": (dict(classifier=Classifier.gap, **moe()), "softmax"),
    "token_choice_bpr": (dict(classifier=Classifier.gap, **moe(
        router=dataclasses.replace(DROPPING, batch_priority=True))), "softmax"),
    "token_choice_bpr_sum": (dict(classifier=Classifier.gap, **moe(router=dataclasses.replace(
        DROPPING, batch_priority=True, priority=Priority.sum))), "softmax"),
    # DeepSeek-V3's sigmoid gates: TOP-k on the scores, weights normalized (BPR reads them).
    "token_choice_sigmoid_bpr": (dict(classifier=Classifier.gap, **moe(router=dataclasses.replace(
        DROPPING, batch_priority=True, gate=Gate.sigmoid))), "softmax"),
    # Auxiliary-loss-free balancing: a (random) per-expert bias chooses, the scores weigh.
    "token_choice_bias": (dict(classifier=Classifier.gap, **moe(router=dataclasses.replace(
        DROPPING, balance=Balance.bias))), "softmax"),
    "token_choice_bias_sigmoid_bpr": (dict(classifier=Classifier.gap, **moe(
        router=dataclasses.replace(DROPPING, batch_priority=True, gate=Gate.sigmoid,
                                   balance=Balance.bias))), "softmax"),
    "token_choice_reference_rounding": (
        dict(num_layers=3, **moe(layers=(1, 2), router=sections.new(RouterConfig, 
            k=2, capacity_ratio=1.0, eval_capacity_ratio=0.3,
            capacity_rounding=CapacityRounding.reference))), "softmax"),
    "token_choice_one_group": (moe(group=8), "softmax"),  # the batch is smaller than a group
    # An upcycled timm ViT: its GELU in every expert, its registers routed with the patches.
    "token_choice_timm_variants": (dict(classifier=Classifier.gap, registers=2, layer_scale=0.1,
                                        activation=Activation.gelu, **moe()), "softmax"),
    "token_choice_qk_norm_map": (dict(classifier=Classifier.map, attention_qk_norm=True,
                                      **moe()), "softmax"),
    "experts_choice": (moe(router=sections.new(RouterConfig, type="experts_choice", capacity_ratio=1.0,
                                               eval_capacity_ratio=0.5)), "softmax"),
    "soft": (moe(router=sections.new(RouterConfig, type="soft", capacity_ratio=1.0)), "softmax"),
    "soft_slots": (dict(classifier=Classifier.gap, **moe(router=sections.new(RouterConfig, 
        type="soft", slots_per_expert=3))), "softmax"),
    # DeepSeekMoE: 8 fine-grained experts of width 32, 4 chosen, plus a shared expert (GAP: the
    # drops at the inference capacity show); a shared expert beside another family.
    "token_choice_shared_split": (dict(classifier=Classifier.gap, **moe(
        shared_experts=1, expert_split=2)), "softmax"),
    "soft_shared": (moe(router=sections.new(RouterConfig, type="soft", capacity_ratio=1.0), shared_experts=2),
                    "softmax"),
    # Dropless token choice (every assignment processed): PyTorch routes at a capacity of S slots
    # per expert, which nothing overflows; with sigmoid gates and DeepSeekMoE's experts too.
    "token_choice_dropless": (dict(classifier=Classifier.gap, **moe(
        router=sections.new(RouterConfig, k=2, dropless=True))), "softmax"),
    "token_choice_dropless_sigmoid_shared_split": (dict(classifier=Classifier.gap, **moe(
        router=sections.new(RouterConfig, k=2, dropless=True, gate=Gate.sigmoid), shared_experts=1,
        expert_split=2)), "softmax"),
    "token_choice_dropless_bias": (dict(classifier=Classifier.gap, **moe(
        router=sections.new(RouterConfig, k=2, dropless=True, balance=Balance.bias))), "softmax"),
    "pbe": (pbe(EnsembleVariant.pbe), "softmax"),
    "pbe_first_block": (pbe(EnsembleVariant.pbe, layers=(0, 1)), "softmax"),
    "pbe_sigmoid": (pbe(EnsembleVariant.pbe), "sigmoid"),
    "tiling_only": (pbe(EnsembleVariant.tiling_only), "softmax"),
    "partition_only": (pbe(EnsembleVariant.partition_only), "softmax"),
    "pbe_bias": (dict(classifier=Classifier.gap, **pbe(EnsembleVariant.pbe, balance=Balance.bias)),
                 "softmax"),
}

# Heteroscedastic heads: (ModelConfig keys over BASE, output). The draws of each case's noise
# matter (checked), and its samples are many, so the Monte-Carlo error is small.
HET_SAMPLES = 16384
HET_CASES = {
    "het": (dict(head=HeadConfig(type=HeadType.het, num_factors=3, eval_mc_samples=HET_SAMPLES,
                                 mc_chunk_size=4096)), "softmax"),
    "het_full_rank_sigmoid": (dict(head=HeadConfig(
        type=HeadType.het, num_factors=3, parameter_efficient=False, temperature=0.3,
        eval_mc_samples=HET_SAMPLES, mc_chunk_size=None)), "sigmoid"),
    "het_xl": (dict(representation_size=16, head=HeadConfig(
        type=HeadType.het_xl, num_factors=4, eval_mc_samples=HET_SAMPLES, mc_chunk_size=5000,
        share_samples_across_batch=True)), "softmax"),
    "het_xl_full_rank_pbe": (dict(head=HeadConfig(
        type=HeadType.het_xl, num_factors=2, parameter_efficient=False, temperature=0.7,
        eval_mc_samples=HET_SAMPLES, mc_chunk_size=4096), **pbe(EnsembleVariant.pbe)),
        "sigmoid"),
}


def random_params(shapes, seed: int):
  """Random parameters of the shapes of an initialised model: kernels N(0, 1/fan_in), norms'
  scales near 1, everything else (biases, tokens, heads' temperatures) N(0, 0.2^2)."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    shape = leaf.shape
    if name.endswith("scale") and "/moe/router/" not in name:
      return (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("_kernel") and "/experts/" in name:  # (E, in, out)
      fan_in = shape[1]
    elif name.endswith(("qkv_kernel", "query/kernel", "key/kernel", "value/kernel")):
      fan_in = shape[0]  # (D, [3,] H, hd)
    elif name.endswith("kernel") or name.endswith("/mu"):
      fan_in = int(np.prod(shape[:-1])) if not name.endswith("/mu") else shape[0]
    else:
      return (0.2 * rng.standard_normal(shape)).astype(np.float32)
    return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def images(seed: int = 0, batch: int = BATCH) -> np.ndarray:
  return np.random.default_rng(seed).uniform(-1, 1, (batch, 16, 16, 3)).astype(np.float32)


def nchw(x: np.ndarray) -> torch.Tensor:
  return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def probabilities(logits, output: str) -> np.ndarray:
  logits = np.asarray(logits, np.float64)
  if output == "sigmoid":
    return 1 / (1 + np.exp(-logits))
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def import_modeling(folder: pathlib.Path, name: str):
  spec = importlib.util.spec_from_file_location(f"modeling_vmoe_{name}",
                                                folder / "modeling_vmoe.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@dataclasses.dataclass
class Exported:
  config: ModelConfig
  output: str
  model: object  # the Flax model
  params: dict
  images: np.ndarray
  logits: np.ndarray  # Flax's
  extras: dict
  folder: pathlib.Path
  modeling: object  # the written modeling_vmoe.py, imported

  @property
  def probs(self) -> np.ndarray:
    return probabilities(self.logits, self.output)

  def torch_model(self):
    return self.modeling.load(self.folder)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
  """export(name) -> Exported: the case built, run in Flax, written and imported (once)."""
  built: dict[str, Exported] = {}
  root = tmp_path_factory.mktemp("exports")

  def get(name: str) -> Exported:
    if name not in built:
      keys, output = {**CASES, **HET_CASES}[name]
      config = dataclasses.replace(BASE, **keys)
      model = build_model(config, CLASSES, output)
      x = images()
      shapes = nn.unbox(jax.eval_shape(
          lambda v: model.init(jax.random.key(0), v, train=False)["params"], x))
      params = random_params(shapes, seed=0)  # same shapes, same values
      apply = jax.jit(lambda p, v: model.apply({"params": p}, v, train=False))
      logits, extras = jax.device_get(apply(params, x))
      folder = root / name
      files.write_model(folder, params=params, model=config, num_classes=CLASSES, output=output)
      built[name] = Exported(config, output, model, params, x, np.asarray(logits), extras,
                             folder, import_modeling(folder, name))
    return built[name]

  return get


# --- parity ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_probabilities_match_flax(export, name):
  e = export(name)
  with torch.no_grad():
    ours = e.torch_model().predict_proba(nchw(e.images)).numpy()
  assert ours.shape == (BATCH, CLASSES)
  np.testing.assert_allclose(ours, e.probs, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", ["token_choice_vanilla", "token_choice_bpr",
                                  "token_choice_bpr_sum", "token_choice_sigmoid_bpr",
                                  "token_choice_bias", "token_choice_bias_sigmoid_bpr",
                                  "token_choice_reference_rounding",
                                  "token_choice_shared_split",
                                  "experts_choice", "pbe", "partition_only"])
def test_the_cases_drop_at_the_inference_capacity(export, name):
  """The capacity cases are meaningful: the Flax model dropped assignments (token choice) or
  left tokens unprocessed (experts choice) in their routing groups."""
  routing = export(name).extras["routing"]
  dropped = [float(m.get("fraction_dropped_assignments", m["fraction_dropped_tokens"]))
             for m in routing.values()]
  assert max(dropped) > 0


def test_the_dropless_cases_drop_nothing_where_capacity_would(export):
  """Dropless: nothing dropped, and the same weights at an inference capacity of C = 0.5 (what
  the capacity cases use) predict otherwise: the dropless routing shows in the parity."""
  for name in ("token_choice_dropless", "token_choice_dropless_sigmoid_shared_split",
               "token_choice_dropless_bias"):
    e = export(name)
    assert all(float(m["fraction_dropped_assignments"]) == 0
               for m in e.extras["routing"].values())
    config = dataclasses.replace(e.config, router=dataclasses.replace(
        e.config.router, dropless=False, eval_capacity_ratio=0.5))
    logits, _ = build_model(config, CLASSES, e.output).apply({"params": e.params}, e.images,
                                                             train=False)
    assert np.abs(probabilities(logits, e.output) - e.probs).max() > 1e-3


def test_routing_orders_change_the_predictions(export):
  """Vanilla routing, BPR by max and BPR by sum drop different assignments of the same model
  (the same parameters), so each case checks its own order."""
  probs = [export(n).probs for n in ("token_choice_vanilla", "token_choice_bpr",
                                     "token_choice_bpr_sum")]
  first = jax.tree_util.tree_leaves(export("token_choice_vanilla").params)
  for n in ("token_choice_bpr", "token_choice_bpr_sum"):
    assert all(np.array_equal(a, b) for a, b in zip(first, jax.tree_util.tree_leaves(
        export(n).params)))
  for i in range(3):
    for j in range(i + 1, 3):
      assert np.abs(probs[i] - probs[j]).max() > 10 * TOLERANCE


def test_routing_groups_change_the_predictions(export):
  """With several routing groups an image's prediction depends on its group: the same image
  in another batch gets other probabilities (the exported model groups images as Flax does)."""
  e = export("token_choice_vanilla")
  model = e.torch_model()
  with torch.no_grad():
    alone = model.predict_proba(nchw(e.images[:2])).numpy()
    swapped = model.predict_proba(nchw(e.images[[0, 2, 1, 3]])).numpy()
  flax_alone = probabilities(e.model.apply({"params": e.params}, e.images[:2], train=False)[0],
                             e.output)
  np.testing.assert_allclose(alone, flax_alone, atol=TOLERANCE, rtol=0)
  assert np.abs(swapped[0] - e.probs[0]).max() > 10 * TOLERANCE  # image 0, grouped with image 2


# --- any batch size: a short last routing group is completed as vmoe eval completes it --------

EVAL_BATCH = 16  # a `vmoe eval` batch, a multiple of every case's routing group
MOE_CASES = [name for name, (keys, _) in CASES.items() if "moe" in keys]


def vmoe_eval_probabilities(e: Exported, x: np.ndarray) -> np.ndarray:
  """What vmoe computes for the batch `x`: a batch smaller than a routing group is one group (as
  vmoe's model routes it); a longer one is routed as `vmoe eval` routes its last batch, completed
  with zero images to EVAL_BATCH (runner/data/pipeline.py `_pad_batch`) and cut into groups of
  `group_size`, and the zero images' rows are dropped."""
  if len(x) >= e.config.moe.group_size:
    x = np.concatenate([x, np.zeros((EVAL_BATCH - len(x), *x.shape[1:]), x.dtype)])
  logits, _ = e.model.apply({"params": e.params}, x, train=False)
  return probabilities(logits, e.output)


@pytest.mark.parametrize("batch", [12, 3])
@pytest.mark.parametrize("name", MOE_CASES)
def test_any_batch_size_gives_vmoe_evals_probabilities(export, name, batch):
  """In groups of 2, 3 images leave a short last group (12 do not); in groups of 8
  (token_choice_one_group), 12 images leave one and 3 are fewer than a group."""
  e = export(name)
  x = images(seed=1, batch=batch)
  with torch.no_grad():
    ours = e.torch_model().predict_proba(nchw(x)).numpy()
  assert ours.shape == (batch, CLASSES)
  np.testing.assert_allclose(ours, vmoe_eval_probabilities(e, x)[:batch], atol=TOLERANCE,
                             rtol=0)


def test_a_short_last_group_is_completed_with_zero_images(export):
  """The last of 3 images (groups of 2) shares its group with a zero image, as in vmoe eval's
  last batch; routed alone, or with a copy of itself, it would get other probabilities (with
  Batch Prioritized Routing and GAP, every token of the group counts), so the test above sees
  which padding the model uses."""
  e = export("token_choice_bpr")
  x = images(seed=1, batch=3)
  model = e.torch_model()
  with torch.no_grad():
    last = model.predict_proba(nchw(x))[2:].numpy()
    alone = model.predict_proba(nchw(x[2:])).numpy()
    with_a_copy = model.predict_proba(nchw(x[[2, 2]]))[:1].numpy()
  with_zeros = vmoe_eval_probabilities(e, np.concatenate([x[2:], np.zeros_like(x[2:])]))[:1]
  np.testing.assert_allclose(last, with_zeros, atol=TOLERANCE, rtol=0)
  assert np.abs(last - alone).max() > 10 * TOLERANCE
  assert np.abs(last - with_a_copy).max() > 10 * TOLERANCE


def test_images_of_the_wrong_shape_are_refused(export):
  model = export("vit_token").torch_model()
  with pytest.raises(ValueError, match=r"images must be \(batch, 3, 16, 16\)"):
    model(torch.zeros(2, 16, 16, 3))


# --- heteroscedastic heads ---------------------------------------------------------------------

def _head_weights(e: Exported) -> tuple[dict, float]:
  head = e.params["head"]
  weights = {k: v for k, v in head.items() if k != "pre_sigmoid_temperature"}
  h = e.config.head
  if h.temperature is not None:
    return weights, float(h.temperature)
  return weights, float(heads.temperature(head["pre_sigmoid_temperature"][0],
                                          *h.temperature_bounds))


@pytest.mark.parametrize("name", list(HET_CASES))
def test_het_heads_match_flax_on_the_same_draws(export, name):
  """The same representation and the same Gaussian draws through both heads: equal to 1e-4."""
  e = export(name)
  model = e.torch_model()
  with torch.no_grad():
    rep = model.representation(nchw(e.images))
  flax_rep = np.array(e.extras["pre_logits"]).reshape(rep.shape)
  np.testing.assert_allclose(rep.numpy(), flax_rep, atol=TOLERANCE, rtol=0)
  h = e.config.head
  rng = np.random.default_rng(7)
  rows = 1 if h.share_samples_across_batch else rep.shape[0]
  z = rng.standard_normal((rows, 64, h.num_factors)).astype(np.float32)
  zeta = rng.standard_normal((rows, 64, 1)).astype(np.float32)
  weights, tau = _head_weights(e)
  want = heads.het_logits(flax_rep, weights, z, zeta, tau, latent=h.type == HeadType.het_xl,
                          parameter_efficient=h.parameter_efficient, output=e.output)
  with torch.no_grad():
    chunks = [(torch.from_numpy(z[:, i:i + 24]), torch.from_numpy(zeta[:, i:i + 24]))
              for i in range(0, 64, 24)]  # chunks as the head draws them; the mean is the same
    got = model.head.mean_logits(torch.from_numpy(flax_rep), chunks)
  np.testing.assert_allclose(probabilities(got.numpy(), e.output),
                             probabilities(want, e.output), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", list(HET_CASES))
def test_het_models_agree_within_monte_carlo_error(export, name):
  """Flax's and PyTorch's probabilities are each the mean over S = 16384 independent draws of
  a probability in [0, 1] (members averaged too: still a mean of S draws of such a value), so
  each has a variance of at most 1/(4S) and their difference, independent estimates of the same
  expectation, a standard deviation of at most sqrt(1/(2S)) = 0.0055. We allow 6 of those,
  0.033; the noise changes the probabilities by more than that (checked), so a head whose noise
  were wrong or missing would fail."""
  e = export(name)
  bound = 6 * math.sqrt(1 / (2 * HET_SAMPLES))
  model = e.torch_model()
  with torch.no_grad():
    ours = model.predict_proba(nchw(e.images), seed=1).numpy()
    again = model.predict_proba(nchw(e.images), seed=1).numpy()
  np.testing.assert_array_equal(ours, again)  # a seed gives the same draws
  assert np.abs(ours - e.probs).max() < bound
  # Without noise (the mean classifier's logits): far from both.
  loc = np.asarray(e.extras["loc_logits"], np.float64)
  if loc.ndim == 3:  # an ensemble's members: their mean probability
    noise_free = probabilities(loc, e.output).mean(axis=1)
  else:
    noise_free = probabilities(loc, e.output)
  assert np.abs(noise_free - e.probs).max() > 2 * bound


# --- every tensor is used, and the layout maps every parameter once ---------------------------

@pytest.mark.parametrize("name", [*CASES, *HET_CASES])
def test_every_tensor_reaches_the_output(export, name):
  e = export(name)
  model = e.torch_model()
  if isinstance(model.head, e.modeling.HeteroscedasticHead):
    model.head.mc_samples = 256  # enough to reach every parameter, and quick
  model(nchw(e.images)).sum().backward()
  # A balance bias only chooses experts (no gradient in Flax either): its effect is checked by
  # test_the_balance_bias_changes_the_choices.
  missing = [n for n, p in model.named_parameters()
             if p.grad is None and not n.endswith(".balance_bias")]
  assert not missing
  from safetensors.numpy import load_file
  stored = load_file(str(e.folder / "model.safetensors"))
  assert set(stored) == {n for n, _ in model.named_parameters()}
  assert all(v.dtype == np.float32 for v in stored.values())


@pytest.mark.parametrize("name", ["token_choice_bias", "token_choice_bias_sigmoid_bpr",
                                  "pbe_bias", "token_choice_dropless_bias"])
def test_the_balance_bias_changes_the_choices(export, name):
  """With the bias zeroed on both sides the predictions change, and still agree: the exported
  bias is what chooses (the partitions' slices of it in an ensemble)."""
  e = export(name)
  model = e.torch_model()
  biases = [n for n, _ in model.named_parameters() if n.endswith(".balance_bias")]
  assert biases
  params = jax.tree_util.tree_map_with_path(
      lambda path, a: np.zeros_like(a) if "balance_bias" in jax.tree_util.keystr(path) else a,
      e.params)
  with torch.no_grad():
    for n, p in model.named_parameters():
      if n.endswith(".balance_bias"):
        p.zero_()
    ours = model.predict_proba(nchw(e.images)).numpy()
  flax = probabilities(e.model.apply({"params": params}, e.images, train=False)[0], e.output)
  np.testing.assert_allclose(ours, flax, atol=TOLERANCE, rtol=0)
  assert np.abs(flax - e.probs).max() > 10 * TOLERANCE


def test_every_flax_parameter_is_written(export):
  """As many tensors and numbers in model.safetensors as Flax parameters, none twice."""
  from safetensors.numpy import load_file
  for name in ("pbe", "soft", "vit_map_qk_norm", "het_xl"):
    e = export(name)
    flat = layout.flatten(e.params)
    stored = load_file(str(e.folder / "model.safetensors"))
    assert len(stored) == len(flat)
    assert sum(v.size for v in stored.values()) == sum(v.size for v in flat.values())


def test_an_unmapped_parameter_is_named(export):
  e = export("token_choice_vanilla")
  params = jax.tree_util.tree_map(lambda a: a, e.params)
  params["block_0"]["mlp"]["extra"] = {"kernel": np.zeros((2, 2), np.float32)}
  params["block_1"]["moe"]["router"]["dense"]["bias"] = np.zeros(4, np.float32)
  with pytest.raises(layout.LayoutError) as error:
    layout.torch_state_dict(params, e.config)
  assert "block_0/mlp/extra/kernel" in str(error.value)
  assert "block_1/moe/router/dense/bias" in str(error.value)
  assert "TorchRouting.parameters" in str(error.value)


def test_a_parameter_mapped_twice_is_refused(export, monkeypatch):
  e = export("token_choice_vanilla")
  base = TokenChoice.torch_routing(e.config.router, tokens=34, experts=4)
  doubled = TorchRouting(config=base.config, source=base.source, class_name=base.class_name,
                         parameters={"dense/kernel": ("dense.weight", (1, 0)),
                                     "copy": ("dense.weight", None)})
  monkeypatch.setattr(TokenChoice, "torch_routing",
                      classmethod(lambda cls, router, *, tokens, experts: doubled))
  params = jax.tree_util.tree_map(lambda a: a, e.params)
  params["block_1"]["moe"]["router"]["copy"] = np.zeros((4, 32), np.float32)
  with pytest.raises(layout.LayoutError, match="block_1/moe/router/copy -> "
                     "blocks.1.moe.router.dense.weight"):
    layout.torch_state_dict(params, e.config)


class NoTorch(RouterFamily):
  """A plug-in family that says nothing of PyTorch (torch_routing keeps its default)."""
  name = "no_torch_export_test"
  summary = "a test family"


def test_a_family_without_torch_routing_is_refused(monkeypatch, tmp_path):
  found = registries.ROUTERS.get
  monkeypatch.setattr(registries.ROUTERS, "get",
                      lambda name: NoTorch if str(name) == NoTorch.name else found(name))
  config = dataclasses.replace(BASE, **moe(router=sections.new(RouterConfig, type=NoTorch.name)))
  problem = architecture.unsupported(config)
  assert problem and NoTorch.name in problem and "torch_routing" in problem
  with pytest.raises(ValueError, match=NoTorch.name):
    files.write_model(tmp_path, params={}, model=config, num_classes=CLASSES, output="softmax")
  assert not list(tmp_path.iterdir())
  assert architecture.unsupported(BASE) is None
  assert architecture.unsupported(dataclasses.replace(BASE, **moe())) is None


# A plug-in family as docs/extending.md would show one: a top-1 router in Flax, and its PyTorch
# source, which uses the exported file's helpers; its gate kernel maps by TorchRouting's default.
TOP1_SOURCE = """
class Top1Router(nn.Module):
  def __init__(self, config, dim, num_experts):
    super().__init__()
    self.ratio = config["capacity_ratio"]
    self.dense = nn.Linear(dim, num_experts, bias=False)

  def forward(self, x, first, count):
    gates = torch.softmax(F.linear(x.float(), self.dense.weight[first:first + count]), dim=-1)
    return plan_top_k(gates, 1, expert_capacity(x.shape[1], count, 1, self.ratio))
"""


class Top1(nn.Module):
  num_experts: int
  capacity_ratio: float = 1.0

  @nn.compact
  def __call__(self, x, *, train: bool):
    logits = nn.Dense(self.num_experts, use_bias=False, name="dense")(x.astype(jnp.float32))
    capacity = routing.expert_capacity(x.shape[1], self.num_experts, 1, self.capacity_ratio)
    plan = routing.plan_dispatch(jax.nn.softmax(logits), k=1, capacity=capacity)
    return plan, {"auxiliary_loss": jnp.zeros(()),
                  "fraction_dropped_tokens": jnp.mean(~plan.kept.any(-1))}


class Top1Family(RouterFamily):
  name = "top1_export_test"
  module = Top1
  summary = "a test plug-in"

  @classmethod
  def module_kwargs(cls, router, *, tokens, experts):
    return dict(capacity_ratio=router.capacity_ratio)

  @classmethod
  def torch_routing(cls, router, *, tokens, experts):
    return TorchRouting(config={"capacity_ratio": router.capacity_ratio}, source=TOP1_SOURCE,
                        class_name="Top1Router")


def test_a_plug_in_family_exports_with_its_own_source(monkeypatch, tmp_path):
  found = registries.ROUTERS.get
  monkeypatch.setattr(registries.ROUTERS, "get",
                      lambda name: Top1Family if str(name) == Top1Family.name else found(name))
  config = dataclasses.replace(BASE, classifier=Classifier.gap, **moe(
      router=sections.new(RouterConfig, type=Top1Family.name, capacity_ratio=0.5)))
  model = build_model(config, CLASSES)
  x = images()
  params = random_params(nn.unbox(jax.eval_shape(
      lambda v: model.init(jax.random.key(0), v, train=False)["params"], x)), seed=0)
  logits, extras = model.apply({"params": params}, x, train=False)
  assert float(extras["routing"]["layer_1"]["fraction_dropped_tokens"]) > 0
  written = files.write_model(tmp_path, params=params, model=config, num_classes=CLASSES,
                              output="softmax")
  assert written["moe"]["router"] == {"type": Top1Family.name, "capacity_ratio": 0.5}
  exported = import_modeling(tmp_path, "plug_in").load(tmp_path)
  assert "blocks.1.moe.router.dense.weight" in exported.state_dict()
  with torch.no_grad():
    ours = exported.predict_proba(nchw(x)).numpy()
  np.testing.assert_allclose(ours, probabilities(logits, "softmax"), atol=TOLERANCE, rtol=0)


# --- what is written ---------------------------------------------------------------------------

def test_config_json_holds_the_inference_settings(export):
  e = export("token_choice_reference_rounding")
  config = json.loads((e.folder / "config.json").read_text())
  assert config["moe"] == {
      "layers": [1, 2], "num_experts": 4, "group_size": 2, "ensemble_size": 1,
      "ensemble_variant": "pbe",
      "router": {"type": "token_choice", "k": 2, "capacity_ratio": 0.3,
                 "capacity_rounding": "reference", "batch_priority": False, "priority": "max"}}
  assert {k: config[k] for k in ("image_size", "patch_size", "num_channels", "hidden_size",
                                 "mlp_dim", "num_layers", "num_heads", "classifier",
                                 "representation_size", "attention_qk_norm", "layer_norm_eps",
                                 "num_classes", "output", "head")} == {
      "image_size": 16, "patch_size": 4, "num_channels": 3, "hidden_size": 32, "mlp_dim": 64,
      "num_layers": 3, "num_heads": 2, "classifier": "token", "representation_size": None,
      "attention_qk_norm": False, "layer_norm_eps": 1e-6, "num_classes": CLASSES,
      "output": "softmax", "head": {"type": "det"}}
  assert json.loads((export("soft").folder / "config.json").read_text())["moe"]["router"] == {
      "type": "soft", "slots_per_expert": 8}  # round(2 images * 17 tokens * 1.0 / 4) = round(8.5)
  het = json.loads((export("het").folder / "config.json").read_text())["head"]
  assert het == {"type": "het", "num_factors": 3, "parameter_efficient": True,
                 "mc_samples": HET_SAMPLES, "temperature": None, "temperature_bounds": [0.05, 5.0],
                 "mc_chunk_size": 4096, "share_samples_across_batch": False}


def test_config_json_holds_the_balance_bias(export):
  router = json.loads((export("token_choice_bias").folder / "config.json").read_text())["moe"][
      "router"]
  assert router["balance"] == "bias"
  assert "balance" not in json.loads((export("token_choice_vanilla").folder / "config.json")
                                     .read_text())["moe"]["router"]


def test_config_json_holds_the_vit_variants_where_used(export):
  """A timm or transformers ViT's variants are written (the qk-norms keep Flax's epsilon), and
  only where used: vmoe's own ViT keeps config.json as it was."""
  keys = ("activation", "layer_norm_eps", "registers", "layer_scale", "pre_norm", "fc_norm",
          "qk_norm_eps")
  config = json.loads((export("vit_timm_variants").folder / "config.json").read_text())
  assert {k: config.get(k) for k in keys} == dict(
      activation="gelu", layer_norm_eps=1e-5, registers=2, layer_scale=True, pre_norm=True,
      fc_norm=True, qk_norm_eps=None)
  config = json.loads((export("vit_map_registers_quick_gelu").folder / "config.json").read_text())
  assert (config["layer_norm_eps"], config["qk_norm_eps"]) == (1e-12, 1e-6)
  plain = json.loads((export("vit_token").folder / "config.json").read_text())
  assert plain["layer_norm_eps"] == 1e-6 and not set(keys[2:]) & set(plain)
  assert "activation" not in plain


def test_config_json_holds_deepseek_experts(export):
  """E*m fine-grained experts chosen k*m at a time, their width and the shared experts; the
  last two only where used (the V-MoE cases keep config.json as it was, above)."""
  moe = json.loads((export("token_choice_shared_split").folder / "config.json").read_text())[
      "moe"]
  assert (moe["num_experts"], moe["router"]["k"], moe["expert_mlp_dim"],
          moe["shared_experts"]) == (8, 4, 32, 1)
  soft = json.loads((export("soft_shared").folder / "config.json").read_text())["moe"]
  assert soft["shared_experts"] == 2 and "expert_mlp_dim" not in soft


def test_extra_config_is_merged(tmp_path, export):
  e = export("vit_token")
  written = files.write_model(tmp_path, params=e.params, model=e.config, num_classes=CLASSES,
                              output="softmax", extra_config={"name": "tiny", "source": {"a": 1}})
  assert json.loads((tmp_path / "config.json").read_text()) == written
  assert written["name"] == "tiny" and written["source"] == {"a": 1}
  with pytest.raises(ValueError, match="predicts 5 classes, not 6"):
    files.write_model(tmp_path, params=e.params, model=e.config, num_classes=6, output="softmax")


def _loading_snippet(where: str, folder: pathlib.Path) -> str:
  """The Python block that loads an export: the card's (written for `folder`), or
  docs/export.md's with its folder pointed at `folder`."""
  if where == "card":
    text = card.model_card(json.loads((folder / "config.json").read_text()), source={},
                           summary={}, parity={"checked": False, "reason": "a test"})
  else:
    text = (ROOT / "docs" / "export.md").read_text()
    text = text[text.index("## Loading it"):]
  snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  return snippet.replace('"runs/down_torch"', repr(str(folder)))


@pytest.mark.parametrize("where", ["card", "docs"])
def test_the_loading_snippet_runs_as_written(export, where, tmp_path):
  """The snippet, run as written in a process of its own in the export folder, next to three
  images of a user's (of other sizes than the model's): it defines everything it uses, and any
  batch size works (3 images in routing groups of 2)."""
  folder = tmp_path / "export"
  shutil.copytree(export("token_choice_vanilla").folder, folder)
  (folder / "config.json").write_text(json.dumps({
      **json.loads((folder / "config.json").read_text()),
      "preprocessing": card.preprocessing_entry("decode(3)|resize(16)|value_range(-1,1)", 16, 3)}))
  snippet = _loading_snippet(where, folder)
  paths = ast.literal_eval(re.search(r"^paths = (\[.*?\])", snippet, re.M).group(1))
  rng = np.random.default_rng(0)
  for i, path in enumerate(paths):
    Image.fromarray(rng.integers(0, 256, (20 + 9 * i, 24, 3), dtype=np.uint8)).save(
        folder / path)
  done = subprocess.run([sys.executable, "-c", snippet + "\nprint(list(probs.shape))"],
                        cwd=folder, capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == str([len(paths), CLASSES])


STDLIB = {"__future__", "fractions", "json", "math", "pathlib"}


def _imports(source: str) -> set[str]:
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      found.add((node.module or "").split(".")[0])
  return found


@pytest.mark.parametrize("name", ["vit_token", "token_choice_vanilla", "experts_choice", "soft"])
def test_the_modeling_file_imports_only_torch_safetensors_and_the_standard_library(export, name):
  source = (export(name).folder / "modeling_vmoe.py").read_text()
  assert _imports(source) <= {"torch", "safetensors"} | STDLIB
  assert source.count(files.MARKER) == 1
  registered = [line for line in source.splitlines() if line.startswith("ROUTERS[")]
  assert len(registered) == (0 if name == "vit_token" else 1)


# Reading a PyTorch pickle (a timm .pth, a pytorch_model.bin) takes torch, imported by the one
# function that unpickles it: where torch is absent, that function says so.
PICKLE_READER = ROOT / "runner/checkpoints/state_dicts.py"


def test_no_module_of_vmoe_imports_torch():
  """The template and the families' PyTorch sources are text that the exporter copies: no
  module of the package imports torch, nor imports them; but the reader of PyTorch pickles,
  inside the function that needs it."""
  copied = {ROOT / "runner/export/modeling_vmoe.py",
            *(ROOT / "runner/models/moe/routers").glob("*_torch.py")}
  for path in sorted((ROOT / "runner").rglob("*.py")):
    source = path.read_text()
    if path in copied:
      continue
    if path == PICKLE_READER:
      module_level = ast.parse(source).body
      assert "torch" not in _imports(ast.unparse(ast.Module(
          [n for n in module_level if isinstance(n, (ast.Import, ast.ImportFrom))], []))), path
      continue
    assert "torch" not in _imports(source), path
    tree = ast.parse(source)
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        names = {f"{node.module}.{a.name}" for a in node.names}
        assert not any(n.endswith(("modeling_vmoe", "_torch")) for n in names), path
  for path in copied - {ROOT / "runner/export/modeling_vmoe.py"}:
    assert _imports(path.read_text()) == set(), path  # it uses the template's names
