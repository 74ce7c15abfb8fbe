"""Values that follow from several keys, computed in one place for the checks and the tasks."""
from __future__ import annotations

from runner.config.schema import DataConfig, FewshotConfig, ModelConfig


def moe_layers(model: ModelConfig) -> tuple[int, ...]:
  """The blocks whose MLP is a mixture of experts (raises ValueError for an invalid spec)."""
  from runner.models.catalog import moe_layer_indices
  return moe_layer_indices(model.moe.layers or [], model.num_layers)


def num_experts(model: ModelConfig) -> int:
  """Experts per MoE layer, 0 for a dense ViT."""
  return int(model.moe.num_experts) if model.moe.num_experts and moe_layers(model) else 0


def eval_batch_size(eval, data: DataConfig) -> int:
  """eval.batch_size, else data.eval_batch_size, else data.batch_size."""
  return int(eval.batch_size or data.eval_batch_size or data.batch_size)


def fewshot_batch_size(fewshot: FewshotConfig, data: DataConfig,
                       eval_batch: int | None = None) -> int:
  """fewshot.batch_size, else the evaluation batch size, else the data's batch size."""
  return int(fewshot.batch_size or eval_batch or data.eval_batch_size or data.batch_size)


def fewshot_in_training(fewshot: FewshotConfig) -> bool:
  return fewshot.every_steps > 0 and bool(fewshot.datasets)
