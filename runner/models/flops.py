"""Analytic model FLOPs: the matmul FLOPs of a forward pass, counted from the architecture.

Conventions (the V-MoE / MFU convention): a (m x k) @ (k x n) matmul costs 2*m*k*n FLOPs; experts
are counted at their padded capacity (every buffer slot is computed, filled or not); dispatch
bookkeeping, softmax, normalisation and activations are not counted. A training step costs three
forward passes (forward, and two matmuls per matmul in the backward pass).
"""
from __future__ import annotations

from runner.config.schema import Classifier, ModelConfig
from runner.models.catalog import moe_layer_indices
from runner.models.moe.routing import expert_capacity


def forward_flops_per_image(config: ModelConfig, num_classes: int, *, batch_size: int,
                            train: bool = True) -> float:
  """Forward matmul FLOPs per image of a model config (the `model.` keys) at `batch_size`."""
  d, m, layers = config.hidden_size, config.mlp_dim, config.num_layers
  p = config.patch_size
  patches = (config.image_size // p) ** 2
  tokens = patches + (1 if config.classifier == Classifier.token else 0)
  flops = 2.0 * patches * (p * p * 3) * d  # patch embedding
  attention = 2.0 * tokens * d * 3 * d + 2 * 2.0 * tokens * tokens * d + 2.0 * tokens * d * d
  dense_mlp = 2 * 2.0 * tokens * d * m
  moe, router = config.moe, config.router
  moe_layers = moe_layer_indices(moe.layers or [], layers) if moe.num_experts else ()
  for i in range(layers):
    flops += attention
    if i not in moe_layers:
      flops += dense_mlp
      continue
    e = moe.num_experts
    ratio = router.capacity_ratio
    if not train and router.eval_capacity_ratio is not None:
      ratio = router.eval_capacity_ratio
    group = min(moe.group_size, batch_size)
    capacity = expert_capacity(group * tokens, e, router.k, ratio)
    slots_per_image = e * capacity / group
    flops += 2.0 * tokens * d * e  # router
    flops += 2 * 2.0 * slots_per_image * d * m  # experts at padded capacity
  if config.classifier == Classifier.map:  # one probe query attending to every token, then an MLP
    flops += 2.0 * d * d + 2.0 * tokens * d * 2 * d + 2 * 2.0 * tokens * d + 2.0 * d * d + 4.0 * d * m
  width = d
  if config.representation_size:
    flops += 2.0 * d * config.representation_size
    width = config.representation_size
  return flops + 2.0 * width * num_classes


def train_flops_per_image(config: ModelConfig, num_classes: int, *, batch_size: int) -> float:
  return 3.0 * forward_flops_per_image(config, num_classes, batch_size=batch_size, train=True)
