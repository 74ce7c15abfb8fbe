"""pretrain and finetune: the same steps; their configs differ (data, optimizer, head)."""
from __future__ import annotations

import dataclasses

import jax

from runner import data
from runner.checkpoints import checkpoint, weights
from runner.config import as_dict, derived
from runner.config.schema import Objective, TrainTask
from runner.errors import ConfigError
from runner.models import build_model, param_updates_of, transfer
from runner.models.moe import routers
from runner.parallel import Placement
from runner.stages import common, contrastive, dataset_specs, fewshot_data, fit
from runner.train import state as state_lib
from runner.train.loop import TrainPlan, train_and_evaluate


def _model_differences(stored: dict, current: dict, prefix: str = "model.") -> str:
  """'model.hidden_size 32 -> 48, ...' for the architecture keys that differ."""
  ignore = {"name", "dropout_rate", "attention_dropout_rate", "dtype", "router", "image_size",
            "expert_dropout", "dispatcher", "grouped_matmul", "group_size"}
  out = []
  for key in sorted((set(stored) | set(current)) - ignore):
    a, b = stored.get(key), current.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      sub = _model_differences(a, b, f"{prefix}{key}.")
      out += [sub] if sub else []
    elif a != b:
      out.append(f"{prefix}{key} {a} -> {b}")
  return ", ".join(out)


def _check_ensemble_size(config: TrainTask, stored: dict) -> None:
  """A partitioned batch ensemble starts another ensemble size only when asked (a V-MoE may start
  any: its experts are partitioned as they are)."""
  stored_size = int((stored.get("model", {}).get("moe") or {}).get("ensemble_size") or 1)
  size = config.model.moe.ensemble_size
  if stored_size > 1 and size != stored_size and not config.init.repartition_experts:
    raise checkpoint.CheckpointError(
        f"init.checkpoint={config.init.checkpoint} is a partitioned batch ensemble of "
        f"{stored_size} members, and model.moe.ensemble_size={size}: its experts would change "
        "members. Set model.moe.ensemble_size to the checkpoint's, or init.repartition_experts="
        "true to divide its experts anew.")


def _router_changes(config: TrainTask, stored: dict | None, restored) -> bool:
  """Whether the model routes with another router family than the checkpoint did: its router
  then starts fresh and the checkpoint's is left out (the experts are kept)."""
  if not derived.num_experts(config.model):
    return False
  family = derived.router_family(config.model)
  if stored:  # our runs say; a config of an older version without router.type has the default
    router = (stored.get("model") or {}).get("router") or {}
    return str(router.get("type") or routers.DEFAULT) != family.name
  # A released checkpoint: its routers' parameter names say (Soft MoE stores slot parameters,
  # the others a (D, E) kernel).
  return not transfer.routers_fit(restored, family)


def init_from_checkpoint(config: TrainTask, model, image_shape: tuple, start: weights.Opened):
  """Parameters for `model` mapped from init.checkpoint, opened as `start` (an earlier stage's run
  or a released checkpoint); with init.tower, from that tower of a contrastive run (a new head)."""
  init = config.init
  stored = start.stored_config()
  if stored is not None:
    _check_ensemble_size(config, stored)
  restored, stored, step = start.load(ensemble_size=derived.ensemble_size(config.model))
  what = f"checkpoint {init.checkpoint} (step {step})"
  if init.tower is not None:  # a contrastive run's (runner/checkpoints/checks.py classifier_from_a_tower)
    restored, what = restored[init.tower.value], f"the {init.tower.value} tower of {what}"
  fresh = state_lib.fresh_params(model, image_shape, config.seed)
  try:
    return transfer.adapt_params(restored, fresh, reinit_head=init.reinit_head,
                                 dense_to_experts=init.dense_to_experts,
                                 drop_upcycling=(init.drop_upcycling_ratio, config.seed),
                                 new_router=_router_changes(config, stored, restored), source=what)
  except checkpoint.CheckpointError as e:
    if not stored:  # a released checkpoint: no config to compare with
      raise checkpoint.CheckpointError(
          f"{e} init.checkpoint={init.checkpoint} is {start.describe()}; pass "
          "the model= that matches it (the head and the position embeddings may differ).") from None
    stored_model = stored.get("model", {})
    diff = _model_differences(stored_model, as_dict(config.model))
    raise checkpoint.CheckpointError(
        f"{e} The checkpoint was trained with model={stored_model.get('name')}"
        + (f", which differs from this one in {diff}" if diff else "")
        + "; pass the same model (and model.* overrides) as that run.") from None


def run_training(config: TrainTask, placement: Placement, checkpoints: weights.Checkpoints,
                 stage: str) -> dict:
  shards = config.data.num_shards
  if shards and shards % jax.process_count():
    raise ConfigError(f"data.num_shards={shards} is not a multiple of the job's "
                      f"{jax.process_count()} processes: each reads an equal number of shards.")
  resuming = checkpoint.has_checkpoints(config.workdir)
  start = None  # the checkpoint a new run starts from; a wrong path fails before the data is read
  if config.init.checkpoint and not resuming:
    start = checkpoints.open(config.init.checkpoint)
  data_config, source = common.open_data(config.data)
  fit.check_batch_fits_the_split(config, data_config.split, source)
  steps = fit.check_schedule_fits_the_run(config, data_config.split, source)
  config = dataclasses.replace(config, data=data_config)
  fewshot = None
  if derived.fewshot_in_training(config.fewshot):  # every dataset checked before any compute
    fewshot = fewshot_data.batches(
        fewshot_data.open_datasets(config.fewshot, config.data),
        derived.fewshot_batch_size(config.fewshot, config.data, config.eval.batch_size))
  if config.objective.name == Objective.contrastive:
    return contrastive.run(config, placement, stage, source=source, resuming=resuming,
                           start=start, fewshot=fewshot, steps=steps)
  if not source.num_classes:
    raise data.DataError(f"data={config.data.name} has no class labels, only image-caption pairs: "
                         "train on them with objective=contrastive, or choose a dataset with "
                         "classes.")
  # OOD datasets of in-training evaluation, checked before any compute as in vmoe eval.
  ood = [dataset_specs.open_dataset(name, config.data, None) for name in config.eval.ood_datasets]
  model = build_model(config.model, source.num_classes,
                      output=derived.model_output(config.train.loss))
  plan = TrainPlan(steps, data.image_shape(source, config.data.split, config.data.pp_train),
                   param_updates_of(config.model, stage))
  init_params = init_from_checkpoint(config, model, plan.image_shape, start) if start else None
  common.write_config(config, config.workdir)
  return train_and_evaluate(config, model=model, source=source, placement=placement, plan=plan,
                            init_params=init_params, stage=stage, fewshot_datasets=fewshot,
                            ood_datasets=ood)
