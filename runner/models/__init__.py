"""Models: ViT and V-MoE from one module, named by the papers' grammar (see `catalog`)."""
from __future__ import annotations

import jax.numpy as jnp

from runner.config import derived
from runner.config.derived import moe_layer_indices, tokens_per_group, tokens_per_image
from runner.config.schema import HeadType, ModelConfig
from runner.models.catalog import UnknownModelError, model_config
from runner.models.moe import grouped_matmul, routers
from runner.models.vit import VisionTransformer


def is_moe(config: ModelConfig) -> bool:
  return bool(derived.num_experts(config))


def param_updates_of(config: ModelConfig, stage: str) -> tuple:
  """What the train step of `stage` sets after the optimizer: the `ParamUpdate`s the router family
  declares (`RouterFamily.param_updates`; token-choice: loss-free balancing's bias); none for a
  dense ViT."""
  if not derived.num_experts(config):
    return ()
  return tuple(derived.router_family(config).param_updates(derived.router(config), stage))


def compiler_options(config: ModelConfig) -> dict:
  """The XLA compiler options every program that runs this model is compiled with
  (`jax.jit(..., compiler_options=)`): none, but for dropless routing by cuDNN's grouped matmul,
  which XLA substitutes for ragged_dot only when asked (runner/models/moe/grouped_matmul.py)."""
  method = str(config.moe.grouped_matmul)
  return grouped_matmul.compiler_options(method) if is_moe(config) else {}


def build_model(config: ModelConfig, num_classes: int, output: str = "softmax") -> VisionTransformer:
  """A `VisionTransformer` from a model config (the `model.` keys), with a head of `num_classes`;
  `output` ("softmax" or "sigmoid", from train.loss): how ensemble members' predictions average."""
  moe, moe_layers = None, ()
  if experts := derived.num_experts(config):  # E, or E*m fine-grained experts; 0 for a dense ViT
    moe_layers, family = derived.moe_layers(config), derived.router_family(config)
    router = family.module_kwargs(derived.router(config), tokens=tokens_per_group(config),
                                  experts=experts)
    if family.name != routers.DEFAULT:  # a token-choice router's arguments stay as they were
      router = {"type": family.name, **router}
    moe = dict(num_experts=experts, group_size=config.moe.group_size,
               expert_dropout=config.moe.expert_dropout,
               dispatcher=str(config.moe.dispatcher), router=router)
    if str(config.moe.grouped_matmul) != "auto":  # dropless plans' grouped matmul, if forced
      moe.update(grouped_matmul=str(config.moe.grouped_matmul))
    if config.moe.ensemble_size > 1:  # a V-MoE's module arguments stay exactly as they were
      moe.update(ensemble_size=config.moe.ensemble_size,
                 ensemble_variant=str(config.moe.ensemble_variant))
    if config.moe.expert_split > 1:  # DeepSeekMoE's experts, only where asked for
      moe.update(mlp_dim=derived.expert_width(config))
    if config.moe.shared_experts:
      moe.update(shared_experts=int(config.moe.shared_experts))
    if config.activation is not None:  # an upcycled timm or transformers ViT's, in every expert
      moe.update(activation=str(config.activation))
  h, head = config.head, None
  if h.type != HeadType.det:
    head = dict(latent=h.type == HeadType.het_xl, num_factors=h.num_factors,
                parameter_efficient=h.parameter_efficient, train_mc_samples=h.train_mc_samples,
                eval_mc_samples=h.eval_mc_samples, temperature=h.temperature,
                temperature_bounds=tuple(h.temperature_bounds), mc_chunk_size=h.mc_chunk_size,
                share_samples_across_batch=h.share_samples_across_batch)
  return VisionTransformer(
      num_classes=num_classes, patch_size=config.patch_size, hidden_size=config.hidden_size,
      num_layers=config.num_layers, mlp_dim=config.mlp_dim, num_heads=config.num_heads,
      classifier=str(config.classifier), representation_size=config.representation_size,
      dropout_rate=config.dropout_rate, attention_dropout_rate=config.attention_dropout_rate,
      attention_qk_norm=config.attention_qk_norm, head_bias_init=config.head_bias_init,
      moe_layers=moe_layers, moe=moe, head=head, output=output,
      dtype=jnp.dtype(str(config.dtype)), attention=str(config.attention),
      activation=None if config.activation is None else str(config.activation),
      layer_norm_eps=float(config.layer_norm_eps), registers=int(config.registers),
      layer_scale=None if config.layer_scale is None else float(config.layer_scale),
      pre_norm=bool(config.pre_norm), fc_norm=bool(config.fc_norm))


__all__ = ["ModelConfig", "UnknownModelError", "VisionTransformer", "build_model", "compiler_options",
           "is_moe", "model_config", "moe_layer_indices", "param_updates_of", "tokens_per_group",
           "tokens_per_image"]
