"""Values that follow from several keys, computed in one place for the checks and the tasks."""
from __future__ import annotations

import re

from runner.config import registries
from runner.config.schema import (DataConfig, EnsembleRun, EnsembleVariant, EvalRun, FewshotConfig,
                                  FewshotRun, ModelConfig)


def moe_layer_indices(layers, num_layers: int) -> tuple[int, ...]:
  """'everyN' -> every N-th block ending at the last; 'lastN' -> the last N of 'every2'; or a list."""
  if isinstance(layers, str):
    m = re.fullmatch(r"(every|last)(\d+)", layers)
    if not m:
      raise ValueError(f"moe.layers={layers!r}: expected 'every<n>', 'last<n>' or a list of block "
                       "indices")
    n = int(m[2])
    if n < 1:
      raise ValueError(f"moe.layers={layers!r} needs n >= 1")
    if m[1] == "every":
      return tuple(range(num_layers - 1, -1, -n))[::-1]
    every2 = tuple(range(1, num_layers, 2))
    if n > len(every2):
      raise ValueError(f"moe.layers={layers!r}: a {num_layers}-block model has only "
                       f"{len(every2)} every-2 blocks")
    return every2[len(every2) - n:]
  indices = tuple(int(i) for i in layers)
  if bad := [i for i in indices if not 0 <= i < num_layers]:
    raise ValueError(f"moe.layers {bad} out of range for a {num_layers}-block model (0..{num_layers - 1})")
  return tuple(sorted(set(indices)))


def moe_layers(model: ModelConfig) -> tuple[int, ...]:
  """The blocks whose MLP is a mixture of experts (raises ValueError for an invalid spec)."""
  return moe_layer_indices(model.moe.layers or [], model.num_layers)


def expert_split(model: ModelConfig) -> int:
  """m of DeepSeekMoE's fine-grained experts (each expert split into m); 1 for V-MoEs and ViTs."""
  return int(model.moe.expert_split) if model.moe.num_experts and moe_layers(model) else 1


def num_experts(model: ModelConfig) -> int:
  """Routed experts per MoE layer (E, or E*m fine-grained ones: the router's choices and the
  expert weights' leading axis); 0 for a dense ViT."""
  return int(model.moe.num_experts) * expert_split(model) if moe_layers(model) else 0


def expert_width(model: ModelConfig) -> int:
  """The hidden width of one routed or shared expert: model.mlp_dim, or mlp_dim / m for
  fine-grained experts, so that E*m experts of k*m choices cost a token what E of k did."""
  return int(model.mlp_dim) // expert_split(model)


def shared_experts(model: ModelConfig) -> int:
  """Experts every token of an MoE layer passes through (model.moe.shared_experts), 0 for a ViT."""
  return int(model.moe.shared_experts) if num_experts(model) else 0


def ensemble_size(model: ModelConfig) -> int:
  """Members of a partitioned batch ensemble (1 for a V-MoE or a ViT)."""
  return int(model.moe.ensemble_size) if num_experts(model) else 1


def expert_partitions(model: ModelConfig) -> int:
  """How many routers split the experts between them (tiling_only has one over all)."""
  return 1 if model.moe.ensemble_variant == EnsembleVariant.tiling_only else ensemble_size(model)


def predictions_per_image(model: ModelConfig) -> int:
  """M for a tiled ensemble (pbe, tiling_only), else 1 (partition_only combines in the layer)."""
  partition_only = model.moe.ensemble_variant == EnsembleVariant.partition_only
  return 1 if partition_only else ensemble_size(model)


def tokens_per_image(model: ModelConfig) -> int:
  """Patches, plus the class token of a `token` classifier and the registers."""
  return ((model.image_size // model.patch_size) ** 2 + int(str(model.classifier) == "token")
          + int(model.registers))


def tokens_per_group(model: ModelConfig) -> int:
  """Tokens of a full routing group (`model.moe.group_size` images)."""
  return model.moe.group_size * tokens_per_image(model)


def experts_per_router(model: ModelConfig) -> int:
  """The experts one routing decision chooses among: E, or E / M for a partitioned ensemble."""
  return num_experts(model) // expert_partitions(model)


def router_family(model: ModelConfig):
  """The family `model.router.type` names (runner/models/moe/routers, or a plug-in's)."""
  return registries.ROUTERS.get(model.router.type)


def router(model: ModelConfig):
  """model.router as the routers route: with fine-grained experts (m > 1) as its family splits
  it (`RouterFamily.split_router`; token-choice: k*m of the E*m experts). What the model, FLOP
  counting, active parameters, the routing analysis and export hand the family."""
  m = expert_split(model)
  if m == 1:
    return model.router
  split = router_family(model).split_router(model.router, m)
  if split is None:
    raise ValueError(f"model.router.type={model.router.type} cannot split its experts "
                     f"(model.moe.expert_split={m})")
  return split


def pre_logits_width(model: ModelConfig) -> int:
  """The width of the representation the classifier head reads."""
  return int(model.representation_size or model.hidden_size)


def eval_batch_size(eval, data: DataConfig) -> int:
  """eval.batch_size, else data.eval_batch_size, else data.batch_size."""
  return int(eval.batch_size or data.eval_batch_size or data.batch_size)


def fewshot_batch_size(fewshot: FewshotConfig, data: DataConfig,
                       eval_batch: int | None = None) -> int:
  """fewshot.batch_size, else the evaluation batch size, else the data's batch size."""
  return int(fewshot.batch_size or eval_batch or data.eval_batch_size or data.batch_size)


def fewshot_in_training(fewshot: FewshotConfig) -> bool:
  return fewshot.every_steps > 0 and bool(fewshot.datasets)


def model_output(loss) -> str:
  """How a model's (or its ensemble members') outputs are probabilities: softmax or sigmoid."""
  return "sigmoid" if loss == "sigmoid_xent" else "softmax"


def held_models(run) -> list[ModelConfig]:
  """The full model configs a run holds: each member's, the model of a training or resolved
  run, none before a later stage has read its checkpoint."""
  if (members := getattr(run, "members", None)) is not None:
    return [m.model for m in members]
  model = getattr(run, "model", None)
  return [model] if isinstance(model, ModelConfig) else []


def input_runs(run) -> list[str]:
  """The runs, checkpoint folders or files a run reads, as given: each member's path, else
  init.checkpoint (one path or a list); none for a run from scratch."""
  if (members := getattr(run, "members", None)) is not None:
    return [str(m.path) for m in members]
  given = getattr(getattr(run, "init", None), "checkpoint", None)
  if not given:
    return []
  return [str(given)] if isinstance(given, str) else [str(path) for path in given]


def inference_batch(run) -> tuple[int, str] | None:
  """(batch size, the key that sets it) of an eval, ensemble or few-shot run; None for training."""
  if isinstance(run, FewshotRun):
    return fewshot_batch_size(run.fewshot, run.data), "fewshot.batch_size"
  if isinstance(run, (EvalRun, EnsembleRun)):
    return eval_batch_size(run.eval, run.data), "eval.batch_size"
  return None
