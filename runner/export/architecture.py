"""config.json of an export: what the PyTorch module needs to rebuild a model config's model at
inference, and what the exporter cannot express.

The router families answer for their routers (`RouterFamily.torch_routing`); they are looked up
in the registry, which the families fill when they are imported (as the CLI imports them)."""
from __future__ import annotations

import typing

from runner.config import derived, relations
from runner.config.schema import HeadType, ModelConfig

if typing.TYPE_CHECKING:
  from runner.models.moe.routers.base import TorchRouting

QK_NORM_EPS = 1e-6  # Flax's LayerNorm default, the qk-norms' whatever model.layer_norm_eps is
OUTPUTS = ("softmax", "sigmoid")
CHANNELS = 3  # what vmoe's preprocessing decodes; files.write_model reads it off the weights


def torch_routing(model: ModelConfig) -> TorchRouting | None:
  """The router family's `TorchRouting` for this model's MoE layers, or None if it gives none."""
  family = derived.router_family(model)
  return family.torch_routing(derived.router(model), tokens=derived.tokens_per_group(model),
                              experts=derived.num_experts(model))


def unsupported(model: ModelConfig) -> str | None:
  """One sentence saying what of `model` the exporter cannot express, or None (the check vmoe
  export runs before anything, runner/config/relations.py)."""
  return relations.unexportable(model)


def _head(model: ModelConfig) -> dict:
  h = model.head
  if h.type == HeadType.det:
    return {"type": "det"}
  return {"type": str(h.type), "num_factors": int(h.num_factors),
          "parameter_efficient": bool(h.parameter_efficient), "mc_samples": int(h.eval_mc_samples),
          "temperature": None if h.temperature is None else float(h.temperature),
          "temperature_bounds": [float(b) for b in h.temperature_bounds],
          "mc_chunk_size": None if h.mc_chunk_size is None else int(h.mc_chunk_size),
          "share_samples_across_batch": bool(h.share_samples_across_batch)}


def _moe(model: ModelConfig) -> dict | None:
  if not derived.num_experts(model):
    return None
  routing = torch_routing(model)
  if routing is None:
    raise ValueError(unsupported(model))
  moe = {"layers": list(derived.moe_layers(model)), "num_experts": derived.num_experts(model),
         "group_size": int(model.moe.group_size), "ensemble_size": int(model.moe.ensemble_size),
         "ensemble_variant": str(model.moe.ensemble_variant),
         "router": {"type": derived.router_family(model).name, **routing.config}}
  # DeepSeekMoE's experts, only where used (an export of a V-MoE stays as it was): E*m
  # fine-grained experts of width mlp_dim/m, and K_s shared experts of that width.
  if derived.expert_split(model) > 1:
    moe["expert_mlp_dim"] = derived.expert_width(model)
  if derived.shared_experts(model):
    moe["shared_experts"] = derived.shared_experts(model)
  return moe


def _vit_variant(model: ModelConfig) -> dict:
  """The keys of a timm or transformers ViT's variants (runner/models/vit.py), each only where
  the model uses it: an export of vmoe's own ViT or V-MoE stays as it was."""
  out = {"activation": str(model.activation)} if model.activation is not None else {}
  if float(model.layer_norm_eps) != QK_NORM_EPS and model.attention_qk_norm:
    out["qk_norm_eps"] = QK_NORM_EPS
  if model.registers:
    out["registers"] = int(model.registers)
  used = {"layer_scale": model.layer_scale is not None, "pre_norm": model.pre_norm,
          "fc_norm": model.fc_norm}
  return {**out, **{key: True for key, on in used.items() if on}}


def config_json(model: ModelConfig, num_classes: int, output: str) -> dict:
  """The architecture and inference settings of `model` with a head of `num_classes` whose
  probabilities are a softmax or sigmoids (`output`), as the exported module reads them."""
  if output not in OUTPUTS:
    raise ValueError(f"unknown output {output!r}; valid: {OUTPUTS}")
  return {
      "model_type": "vmoe",
      "image_size": int(model.image_size), "patch_size": int(model.patch_size),
      "num_channels": CHANNELS, "hidden_size": int(model.hidden_size),
      "mlp_dim": int(model.mlp_dim), "num_layers": int(model.num_layers),
      "num_heads": int(model.num_heads), "classifier": str(model.classifier),
      "representation_size": (int(model.representation_size) if model.representation_size
                              else None),
      "attention_qk_norm": bool(model.attention_qk_norm),
      "layer_norm_eps": float(model.layer_norm_eps), **_vit_variant(model),
      "num_classes": int(num_classes), "output": output, "moe": _moe(model), "head": _head(model),
  }
