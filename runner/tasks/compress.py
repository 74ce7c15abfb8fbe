"""`vmoe compress init.checkpoint=<run> compress.method=prune|merge compress.experts=<E'>`: a run
folder whose checkpoint has E' routed experts per MoE layer (docs/compression.md).

One pass over the calibration images gathers each layer's routing statistics
(runner/models/expert_statistics.py); runner/models/compression.py turns them into the experts kept or
merged; a second pass measures the compressed model on the same images. The folder holds the
checkpoint (its stored config the compressed model's: later stages take it as any run),
summary.json with the statistics used, and a picture of them. What can be refused (a Soft MoE, a
dense ViT, E' that does not fit) was refused before this runs (runner/config/relations.py)."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import numpy as np

from runner import data
from runner.checkpoints import checkpoint, weights
from runner.config import as_dict, derived
from runner.config.schema import CompressMethod, CompressRun, ModelConfig
from runner.errors import ConfigError
from runner.evaluators import routing_plots
from runner.evaluators.predictions import PredictionStats
from runner.models.size import count_params
from runner.logging import MetricWriter, environment
from runner.logging.progress import Progress
from runner.models import build_model, compression, heads, introspection, transfer
from runner.parallel import Placement
from runner.datasets import dataset_specs
from runner.models import expert_statistics
from runner.stages import setup


def run(config: CompressRun, placement: Placement, checkpoints: weights.Checkpoints) -> dict:
  del placement  # one process reads the calibration set and writes the folder
  c, path = config.compress, config.init.checkpoint
  d, source, split = _calibration_data(config)
  opened = checkpoints.open(path)
  params, stored, step = opened.load(ensemble_size=derived.ensemble_size(config.model))
  num_classes, output = heads.num_classes(params), derived.model_output(config.loss)
  if source.num_classes != num_classes:
    raise ConfigError(f"the calibration dataset {d.name!r} has {source.num_classes} classes but "
                      f"the checkpoint's head predicts {num_classes}; calibrate on data with the "
                      "same label space (data=<the dataset the run was trained on>).")
  model = build_model(config.model, num_classes, output=output)
  image_shape = data.image_shape(source, split, d.pp)
  setup.check_params_fit(path, step, params, model, image_shape, "compress")
  _check_routers(params, blocks=derived.moe_layers(config.model),
                 experts=derived.num_experts(config.model), family=config.model.router.type)
  smaller = compressed_model(config.model, c.experts)
  # How a partitioned ensemble's rows and experts lie (runner/models/moe/layer.py).
  layout = {"partitions": derived.expert_partitions(config.model),
            "tiled": derived.predictions_per_image(config.model) > 1}
  batch = int(d.eval_batch_size or d.batch_size)

  def calibrate(net, net_params, first: bool, what: str):
    predictions = PredictionStats(loss_name=config.loss.value)
    batches = data.eval_batches(source, split, d.pp, batch, cache=False).as_numpy_iterator()
    bar = Progress(-(-source.num_examples(split) // batch), 0, batch, desc=f"compress: {what}",
                   enabled=config.logger.progress)
    try:
      stats, seen = expert_statistics.gather(net, net_params, batches, examples=c.examples,
                                             outputs=first and c.method == CompressMethod.merge,
                                             keep_io=first, predictions=predictions, **layout,
                                             progress=lambda seen: bar.step_done(-(-seen // batch)))
    finally:
      bar.close()
    return stats, predictions.metrics("calibration"), seen

  stats, before, seen = calibrate(model, params, True, "statistics")
  small_model = build_model(smaller, num_classes, output=output)
  block = {"mlp_dim": small_model.mlp_dim, **small_model.moe, "dtype": small_model.dtype}
  plans, new_params, errors = _compress(params, stats, c, layout["partitions"], block)
  after_stats, after, _ = calibrate(small_model, new_params, False, "compressed model")
  out = pathlib.Path(config.workdir)
  environment.write_config(config, str(out))
  _save(out / "checkpoints", step, new_params, _stored_config(config, stored, smaller))
  summary = _summary(config, smaller, plans, stats, after_stats, before, after, seen, split)
  summary.update({f"compress/{layer}/output_error": e for layer, e in errors.items()})
  summary.update({"checkpoint_step": step, "compress/parameters_before": count_params(params),
                  "compress/parameters": count_params(new_params)})
  picture = routing_plots.compressed_experts(
      {layer: (s.chosen, plans[layer], after_stats[layer].chosen) for layer, s in stats.items()},
      str(c.method), out / "compressed_experts.png")
  with MetricWriter(str(out), run_config=as_dict(config), wandb=config.logger.wandb,
                    job_type="compress") as writer:
    writer.write(step, {k: v for k, v in summary.items() if isinstance(v, (int, float))})
    writer.log_image(step, "compress/experts_picture", picture)
    writer.summary(summary)
  _print(config, smaller, summary)
  return summary


def _calibration_data(config: CompressRun):
  """(data config, source, split): the calibration images, the split checked to hold some."""
  split = config.compress.split or config.data.split
  ds = dataset_specs.open_dataset(config.data.name, config.data, split,
                                  role=f"calibration data (compress.split={split})")
  # Read whole: no pass stops inside the split.
  return ds.config, ds.source, ds.source.head(split, config.compress.examples)


def _check_routers(params, *, blocks, experts: int, family: str) -> None:
  """Every router parameter must have the experts as its last axis, the one compression
  selects or averages along (a plug-in family's scalar or (D, D) parameter has no such axis)."""
  for block in blocks:
    router = transfer.flatten(params[f"block_{block}"][introspection.MOE_LAYER]["router"])
    if odd := [f"{k} {tuple(np.shape(v))}" for k, v in router.items()
               if not np.ndim(v) or np.shape(v)[-1] != experts]:
      raise ConfigError(f"model.router.type={family} has router parameters whose last axis is "
                        f"not the {experts} experts ({', '.join(odd)} in block {block}), so vmoe "
                        "compress cannot tell how to keep or merge them; it compresses routers "
                        "whose parameters each hold one column per expert (token_choice, "
                        "experts_choice).")


def compressed_model(model: ModelConfig, experts: int) -> ModelConfig:
  """The model with `experts` routed experts per MoE layer; a token-choice k larger than what a
  member's experts allow becomes that many (the relation that refuses E' said when it cannot)."""
  split, members = derived.expert_split(model), derived.expert_partitions(model)
  moe = dataclasses.replace(model.moe, num_experts=experts // split)
  router = model.router
  if getattr(router, "k", None) and router.k * split > experts // members:
    router = dataclasses.replace(router, k=experts // members // split)
  return dataclasses.replace(model, moe=moe, router=router)


def _compress(params, stats: dict, c, partitions: int, block: dict) -> tuple[dict, dict, dict]:
  """({layer: plan}, the parameters with each MoE layer's experts and router compressed, {layer: its
  relative output error on the calibration tokens}). `block`: the compressed MoeMlpBlock's args."""
  plans, errors, params = {}, {}, dict(params)
  for layer, s in stats.items():
    name = f"block_{layer.rsplit('_', 1)[-1]}"
    moe = params[name][introspection.MOE_LAYER]
    if c.method == CompressMethod.prune:  # Lu et al.: the subset whose output is nearest
      candidates = list(compression.subsets(len(s.chosen), c.experts, partitions))
      measured = expert_statistics.reconstruction_errors(
          block, s.io, (_planned(moe, [[e] for e in kept], s.chosen) for kept in candidates))
      best = int(np.argmin(measured))
      plan, errors[layer] = [[e] for e in candidates[best]], measured[best]
    elif c.method == CompressMethod.prune_frequency:
      plan = compression.prune_plan(s.chosen, s.weights, c.experts, partitions)
    else:
      plan = compression.merge_plan(s.mean_outputs, c.experts, partitions)
    compressed = _planned(moe, plan, s.chosen)
    if layer not in errors:  # prune measured its choice already
      errors[layer] = expert_statistics.reconstruction_errors(block, s.io, [compressed])[0]
    params[name] = {**params[name], introspection.MOE_LAYER: compressed}
    plans[layer] = plan
  return plans, params, errors


def _planned(moe: dict, plan: list[list[int]], chosen: np.ndarray) -> dict:
  """A MoE layer's parameters with new expert j made of plan[j]'s (shared experts as they were)."""
  experts, router = compression.apply_plan(moe["experts"], transfer.flatten(moe["router"]), plan,
                                           chosen)
  return {**moe, "experts": experts, "router": transfer.unflatten(router)}


def _stored_config(config: CompressRun, stored: dict, model: ModelConfig) -> dict:
  """What later stages read from the checkpoint: the compressed model, the calibration data's
  preprocessing, the source's loss and objective, and where it came from."""
  own, stored = as_dict(config), stored or {}
  return {**stored, "model": as_dict(model), "data": own["data"],
          "train": {**(stored.get("train") or {}), "loss": config.loss.value},
          "objective": own["objective"], "init": own["init"], "compress": own["compress"],
          "seed": stored.get("seed", config.seed), "workdir": config.workdir, "stage": "compress"}


def _save(directory: pathlib.Path, step: int, params, stored: dict) -> None:
  saver = checkpoint.Checkpointer(directory, keep=1, async_save=False)
  try:
    # No optimizer state survives compression; Orbax saves no empty tree, so a marker stands in.
    saver.save(step, params, {"none": np.zeros((), np.int32)}, {"step": step, "position": 0},
               stored)
  finally:
    saver.close()


def _summary(config, model, plans, stats, after_stats, before, after, seen, split) -> dict:
  """The run's numbers, and per layer (compress/layer_<i>/...) the statistics the plan read:
  tokens choosing each expert, those its buffer took, their summed weights; the new expert each
  became (-1: pruned); the compressed model's choices on the same images."""
  summary = {"compress/experts": config.compress.experts,
             "compress/experts_before": derived.num_experts(config.model),
             "compress/method": str(config.compress.method), "compress/calibration_images": seen,
             "compress/calibration_split": split,
             **{f"{k}_before": v for k, v in before.items()}, **after}
  for layer, s in stats.items():
    summary.update({f"compress/{layer}/{k}": v for k, v in dict(
        chosen=s.chosen.tolist(), routed=s.routed.tolist(), weights=s.weights.tolist(),
        tokens=s.tokens, new_expert=_new_expert(plans[layer], len(s.chosen)),
        chosen_after=after_stats[layer].chosen.tolist()).items()})
  if getattr(model.router, "k", None) != getattr(config.model.router, "k", None):
    summary["compress/k"] = model.router.k
  return summary


def _new_expert(plan: list[list[int]], experts: int) -> list[int]:
  new = {e: j for j, group in enumerate(plan) for e in group}
  return [new.get(e, -1) for e in range(experts)]


def _print(config: CompressRun, model: ModelConfig, summary: dict) -> None:
  c = config.compress
  changed = (f"; model.router.k {config.model.router.k} -> {model.router.k} (a member keeps "
             f"fewer experts than it chose)" if "compress/k" in summary else "")
  print(f"vmoe compress: {config.workdir}: {c.method} {summary['compress/experts_before']} -> "
        f"{c.experts} experts per MoE layer on {summary['compress/calibration_images']} images of "
        f"{config.data.name}:{summary['compress/calibration_split']}{changed}; calibration "
        f"prec@1 {summary['calibration/prec@1_before']:.4f} -> "
        f"{summary['calibration/prec@1']:.4f}. Later stages take it as init.checkpoint (vmoe "
        f"finetune with model.moe.num_experts={model.moe.num_experts}"
        + (f" model.router.k={model.router.k}" if "compress/k" in summary else "") + ").",
        file=sys.stdout)
