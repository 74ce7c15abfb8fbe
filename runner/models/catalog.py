"""Model names in the papers' grammar, resolved from their size tables.

  vit_<size><patch>                              vit_s32, vit_b16, vit_l16, vit_h14
  vmoe_<size><patch>_<every|last><n>[_e<E>][_k<k>][_s<S>][_f<F>][_m<M>]
                                                 vmoe_s32_last2, vmoe_b16_every2_e32_k2
  softmoe_<size><patch>[_e<E>][_p<P>]            softmoe_s16_e128, softmoe_b16_e128_p2
  ecmoe_<size><patch>[_e<E>]                     ecmoe_s16_e128 (experts-choice routing)
  vit_tiny, vmoe_tiny[_k<k>][_s<S>][_f<F>][_m<M>], softmoe_tiny[_p<P>], ecmoe_tiny
                                                 CPU sizes (image 32, patch 4)

docs/models.md and docs/routers.md ("Models") say what each part means; the Soft MoE paper's
models (`softmoe_*`, `ecmoe_*`) have that paper's own ViT sizes (`SOFT_SIZES`), and their CPU
sizes vmoe_tiny's shape with one image per routing group."""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from runner.config import components, sections
from runner.config.registries import Registry
from runner.config.schema import Classifier, ModelConfig, MoeConfig, RouterConfig
from runner.errors import UserError

# name: (hidden_size, num_layers, mlp_dim, num_heads)
SIZES = {
    "tiny": (128, 4, 512, 4),
    "ti": (192, 12, 768, 3),
    "s": (512, 8, 2048, 8),
    "b": (768, 12, 3072, 12),
    "l": (1024, 24, 4096, 16),
    "h": (1280, 32, 5120, 16),
}
PAPER_MODELS = (
    "vit_s32", "vit_b32", "vit_b16", "vit_l32", "vit_l16", "vit_h14",
    "vmoe_s32_last2", "vmoe_s32_every2", "vmoe_b32_last2", "vmoe_b32_every2", "vmoe_b16_last2",
    "vmoe_b16_every2", "vmoe_l32_last2", "vmoe_l16_last2", "vmoe_l16_every2", "vmoe_h14_last5",
    "vmoe_h14_every2",
)
# The Soft MoE paper's ViT sizes (its reference configs: Ti, S, B, L, H): ours, but for S.
SOFT_SIZES = {"ti": SIZES["ti"], "s": (384, 12, 1536, 6), "b": SIZES["b"], "l": SIZES["l"],
              "h": SIZES["h"]}
_SOFT_LAST_N = {"ti": 6, "s": 6, "b": 6, "l": 12, "h": 16}
SOFT_MOE_MODELS = ("softmoe_s16_e128", "softmoe_s14_e256", "softmoe_b16_e128", "softmoe_l16_e128",
                   "softmoe_h14_e256", "ecmoe_s16_e128", "ecmoe_b16_e128")
CPU_MODELS = ("vit_tiny", "vmoe_tiny", "softmoe_tiny", "ecmoe_tiny")
_NAME = re.compile(
    r"^(?P<kind>vit|vmoe)_(?:(?P<tiny>tiny)|(?P<size>ti|s|b|l|h)(?P<patch>\d+))"
    r"(?:_(?P<place>every|last)(?P<n>\d+))?(?:_e(?P<e>\d+))?(?:_k(?P<k>\d+))?"
    r"(?:_s(?P<s>\d+))?(?:_f(?P<f>\d+))?(?:_m(?P<m>\d+))?$")
_SOFT_NAME = re.compile(
    r"^(?P<kind>softmoe|ecmoe)_(?:(?P<tiny>tiny)|(?P<size>ti|s|b|l|h)(?P<patch>\d+))"
    r"(?:_e(?P<e>\d+))?(?:_p(?P<p>\d+))?$")


class UnknownModelError(UserError, ValueError):
  pass


# Names a plug-in registers (`register`), each with a function that makes its config.
_REGISTERED: Registry = Registry("model name", "model")
KIND = components.Kind(_REGISTERED)  # no keys: a model's keys are model.*


def register(name: str, make: Callable[[], ModelConfig] | ModelConfig) -> None:
  """Adds `model=<name>` for a plug-in: a ModelConfig, or a function returning one (e.g. a
  catalog name with another router: `dataclasses.replace(model_config("vmoe_tiny"), ...)`)."""
  if _NAME.match(name) or _SOFT_NAME.match(name):
    raise UserError(f"model name {name!r} is already taken by the catalog's grammar: choose "
                    "another name for the plug-in's model.")
  factory = make if callable(make) else (lambda: dataclasses.replace(make))
  components.register(KIND, name, factory)


def registered_names() -> list[str]:
  """The names `model=` lists: the CPU sizes, the papers' models, then the plug-ins'."""
  return list(CPU_MODELS + PAPER_MODELS + SOFT_MOE_MODELS) + list(_REGISTERED)


def model_config(name: str) -> ModelConfig:
  """The full model config (constructor arguments plus image_size) for a name in the grammar,
  or registered by a plug-in."""
  if name in _REGISTERED:
    return dataclasses.replace(_REGISTERED.get(name)(), name=name)
  soft = _SOFT_NAME.match(name)
  if soft and not (soft["kind"] == "ecmoe" and soft["p"]):
    return _soft_moe_paper_model(name, soft)
  m = _NAME.match(name)
  if not m or (m["kind"] == "vit" and any(m[g] for g in ("place", "e", "k", "s", "f", "m"))):
    raise UnknownModelError(
        f"unknown model {name!r}. Valid names: {', '.join(registered_names())}, or any "
        "vit_<size><patch> / vmoe_<size><patch>_<every|last><n>[_e<E>][_k<k>][_s<S>][_f<F>]"
        f"[_m<M>] with size in {{{', '.join(s for s in SIZES if s != 'tiny')}}} (e.g. "
        "vmoe_b16_every2_e32_k2, vmoe_tiny_k1_m2, vmoe_tiny_s1_f2), softmoe_<size><patch>[_e<E>]"
        f"[_p<P>] or ecmoe_<size><patch>[_e<E>] with size in {{{', '.join(SOFT_SIZES)}}} (the "
        "Soft MoE paper's ViT sizes).")
  tiny = bool(m["tiny"])
  hidden, layers, mlp, heads = SIZES["tiny" if tiny else m["size"]]
  moe, router = MoeConfig(layers=[], num_experts=0), sections.new(RouterConfig, k=int(m["k"] or 2))
  if m["kind"] == "vmoe":
    placement = f"{m['place'] or 'every'}{m['n'] or 2}"
    moe = MoeConfig(layers=placement, num_experts=int(m["e"] or (8 if tiny else 32)),
                    ensemble_size=int(m["m"] or 1), shared_experts=int(m["s"] or 0),
                    expert_split=int(m["f"] or 1))
  return ModelConfig(name=name, image_size=32 if tiny else 224,
                     patch_size=4 if tiny else int(m["patch"]), hidden_size=hidden,
                     num_layers=layers, mlp_dim=mlp, num_heads=heads, moe=moe, router=router)


def _soft_moe_paper_model(name: str, m) -> ModelConfig:
  """softmoe_* / ecmoe_*: the Soft MoE paper's shapes (docs/routers.md, "Models")."""
  router_type = "soft" if m["kind"] == "softmoe" else "experts_choice"
  if m["tiny"]:
    hidden, layers, mlp, heads = SIZES["tiny"]
    image, patch, placement, experts, qk_norm = 32, 4, "every2", int(m["e"] or 8), False
  else:
    hidden, layers, mlp, heads = SOFT_SIZES[m["size"]]
    image, patch, qk_norm = 224, int(m["patch"]), True
    placement = list(range(layers - _SOFT_LAST_N[m["size"]], layers))
    experts = int(m["e"] or (256 if patch == 14 else 128))
  # Soft MoE's slots per expert (the paper's 1 at full size); experts-choice reads no such key.
  slots = None if router_type != "soft" or m["tiny"] and not m["p"] else int(m["p"] or 1)
  router = sections.new(RouterConfig, type=router_type, capacity_ratio=1.0, slots_per_expert=slots)
  return ModelConfig(name=name, image_size=image, patch_size=patch, hidden_size=hidden,
                     num_layers=layers, mlp_dim=mlp, num_heads=heads, classifier=Classifier.gap,
                     attention_qk_norm=qk_norm, router=router,
                     moe=MoeConfig(layers=placement, num_experts=experts, group_size=1))
