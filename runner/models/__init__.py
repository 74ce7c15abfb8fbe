"""Models: ViT and V-MoE from one module, named by the papers' grammar (see `catalog`)."""
from __future__ import annotations

import jax.numpy as jnp

from runner.models.catalog import UnknownModelError, model_config, moe_layer_indices
from runner.models.vit import VisionTransformer

_ROUTER_KEYS = ("k", "capacity_ratio", "eval_capacity_ratio", "batch_priority", "priority",
                "noise_std")


def is_moe(config: dict) -> bool:
  return bool(config.get("moe", {}).get("num_experts")) and bool(
      moe_layer_indices(config["moe"].get("layers", ()), config["num_layers"]))


def build_model(config: dict, num_classes: int) -> VisionTransformer:
  """A `VisionTransformer` from a model config (the `model.` keys), with a head of `num_classes`."""
  moe_cfg = config.get("moe") or {}
  moe_layers = moe_layer_indices(moe_cfg.get("layers", ()), config["num_layers"]) if is_moe(config) else ()
  moe = None
  if moe_layers:
    router = {k: v for k, v in (config.get("router") or {}).items() if k in _ROUTER_KEYS}
    moe = dict(num_experts=moe_cfg["num_experts"], group_size=moe_cfg.get("group_size", 8),
               expert_dropout=moe_cfg.get("expert_dropout", 0.0),
               dispatcher=moe_cfg.get("dispatcher", "indices"), router=router)
  return VisionTransformer(
      num_classes=num_classes, patch_size=config["patch_size"], hidden_size=config["hidden_size"],
      num_layers=config["num_layers"], mlp_dim=config["mlp_dim"], num_heads=config["num_heads"],
      classifier=config.get("classifier", "token"),
      representation_size=config.get("representation_size"),
      dropout_rate=config.get("dropout_rate", 0.0),
      attention_dropout_rate=config.get("attention_dropout_rate", 0.0),
      head_bias_init=config.get("head_bias_init", 0.0), moe_layers=moe_layers, moe=moe,
      dtype=jnp.dtype(config.get("dtype", "float32")))


__all__ = ["UnknownModelError", "VisionTransformer", "build_model", "is_moe", "model_config",
           "moe_layer_indices"]
