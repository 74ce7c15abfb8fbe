"""`vmoe fewshot init.checkpoint=<run>`: linear few-shot accuracy of frozen pre-logit features.

Each checkpoint's model comes from the config stored with it; model.* keys change inference
settings on top (router k, capacity, Batch Prioritized Routing). Datasets are read with the
checkpoint's eval preprocessing. Several checkpoints (init.checkpoint=[runs/a,runs/b]) are probed
as one representation, their pre-logits concatenated, so they must preprocess images alike.
"""
from __future__ import annotations

import functools
import pathlib
import sys

import jax

from runner import checkpoint, data, parallel
from runner.config import validate
from runner.errors import ConfigError
from runner.evaluators.fewshot import (FewshotEvaluator, accuracy_table, format_table,
                                       make_feature_fn, plot_accuracy_vs_shots)
from runner.logging import MetricWriter
from runner.models import transfer
from runner.tasks import common, fewshot_data
from runner.tasks.overrides import model_with_overrides
from runner.train import state as state_lib

PLOT = "fewshot_accuracy.png"


def checkpoint_paths(value) -> list[str]:
  """init.checkpoint as a list of paths: one workdir, or a list of them."""
  paths = [value] if isinstance(value, str) else list(value or [])
  paths = [str(p) for p in paths if p is not None and str(p).strip()]
  if not paths:
    raise ConfigError("vmoe fewshot needs init.checkpoint=<workdir of a pretrain/finetune run>, or "
                      "a list of them, init.checkpoint=[runs/a,runs/b], to concatenate their "
                      "pre-logit features.")
  return paths


def shared_data_config(paths: list[str], stored: list[dict]) -> dict:
  """The first checkpoint's data config; every checkpoint must preprocess images the same way."""
  pps = [s.get("data", {}).get("pp") for s in stored]
  if len(set(pps)) > 1:
    listing = "; ".join(f"{p}: {pp!r}" for p, pp in zip(paths, pps))
    raise ConfigError("the checkpoints of init.checkpoint preprocess images differently, so their "
                      f"features cannot be concatenated image by image ({listing}); combine "
                      "checkpoints trained at the same resolution and value range.")
  return dict(stored[0]["data"])


def _check_fits(path: str, step: int, params, model, image_shape) -> None:
  """The restored parameters have the shapes the (possibly overridden) model expects."""
  abstract, _ = state_lib.abstract_params(model, image_shape)
  want, have = transfer.flatten(abstract), transfer.flatten(params)
  problems = [f"{name}: checkpoint {tuple(have[name].shape) if name in have else 'missing'} vs "
              f"model {tuple(target.shape)}" for name, target in want.items()
              if name not in have or tuple(have[name].shape) != tuple(target.shape)]
  problems += [f"{name}: not in the model" for name in have if name not in want]
  if problems:
    more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
    shown = "; ".join(problems[:4]) + more
    raise checkpoint.CheckpointError(
        f"checkpoint {path} (step {step}) does not fit its model with the given model.* keys "
        f"({shown}). In vmoe fewshot, model.* may change inference settings (model.router.*, "
        "model.dtype), not the architecture.")


def _say(enabled: bool, text: str) -> None:
  if enabled and jax.process_index() == 0:
    print(text, file=sys.stderr, flush=True)


def run(cfg, workdir: str) -> dict:
  config = common.plain_config(cfg, workdir)
  paths = checkpoint_paths(config["init"].get("checkpoint"))
  fewshot = config["fewshot"]
  fewshot_data.check_config(fewshot)
  parallel.initialize(config.get("distributed"))
  verbose = config["logger"].get("progress", True)

  # Everything that can be wrong is checked from configs, split sizes and labels first.
  stored = [checkpoint.read_config(p) for p in paths]
  models = [model_with_overrides(s["model"], config["model"]) for s in stored]
  for model_cfg in models:
    validate.check_model(model_cfg)
  base = shared_data_config(paths, stored)
  batch_size = fewshot_data.batch_size(fewshot, base)
  for model_cfg in models:
    validate.check_batch(batch_size, model_cfg, what="fewshot.batch_size")
  config.update(model=models[0], data=base)
  config["init"]["checkpoint"] = paths if len(paths) > 1 else paths[0]
  if len(models) > 1:
    config["models"] = models
  placement = common.make_placement(config)
  opened = fewshot_data.open_datasets(fewshot, base)
  first = next(iter(opened.values()))
  image_shape = data.image_shape(first.source, first.test_split, base["pp"])

  members = []
  for path, model_cfg in zip(paths, models):
    params, _, step = checkpoint.load_params(path)
    model = common.build_checked_model(model_cfg, int(params["head"]["kernel"].shape[-1]))
    _check_fits(path, step, params, model, image_shape)
    members.append((path, step, model, params))
  common.write_config(config, workdir)
  for name, f in opened.items():
    _say(verbose, f"[fewshot] {name}: {f.source.num_classes} classes, pool {f.train_split} "
                  f"({f.num_train} images, smallest class {int(f.class_counts.min())}), test "
                  f"{f.test_split} ({f.num_test} images)")
  _say(verbose, "[fewshot] features of " + " + ".join(
      f"{model_cfg['name']} ({path}, step {step})"
      for (path, step, _, _), model_cfg in zip(members, models))
      + f"; shots {fewshot['shots']}, seeds {fewshot['seeds']} -> {workdir}")

  with placement.context():
    feature_fns = []
    for _, _, model, params in members:
      _, logical = state_lib.abstract_params(model, image_shape)
      placed = jax.device_put(params, placement.shardings(logical))
      feature_fns.append(functools.partial(jax.jit(make_feature_fn(model)), placed))
    evaluator = FewshotEvaluator(feature_fns, fewshot_data.batches(opened, batch_size, cache=False),
                                 shots=fewshot["shots"], seeds=fewshot["seeds"],
                                 l2_regs=fewshot.get("l2_regs"), put=placement.put,
                                 progress=verbose)
    metrics = evaluator.run()

  step = members[0][1]
  summary = {"checkpoint": config["init"]["checkpoint"],
             "checkpoint_step": step if len(members) == 1 else [m[1] for m in members]}
  for name, f in opened.items():
    summary.update({f"{name}/train_split": f.train_split, f"{name}/test_split": f.test_split,
                    f"{name}/num_train": f.num_train, f"{name}/num_test": f.num_test,
                    f"{name}/num_classes": f.source.num_classes})
  summary.update(metrics)
  writer = MetricWriter(workdir, run_config=config, wandb=config["logger"]["wandb"],
                        job_type="fewshot")
  try:
    writer.write(step, metrics)
    writer.summary(summary)
    if jax.process_index() == 0:
      title = " + ".join(f"{m['name']} (step {s})" for m, (_, s, _, _) in zip(models, members))
      plot = plot_accuracy_vs_shots(metrics, str(pathlib.Path(workdir) / PLOT),
                                    title=f"linear few-shot: {title}")
      writer.log_image(step, "fewshot/accuracy_vs_shots", plot)
      writer.log_table("fewshot/accuracy", *_table_rows(metrics))
      print(format_table(metrics))
  finally:
    writer.close()
  return summary


def _table_rows(metrics: dict) -> tuple[list[str], list[list]]:
  """(columns, rows) of the accuracy table: dataset, then one column per number of shots."""
  names, shots, table = accuracy_table(metrics)
  return ["dataset", *[f"{s}shot" for s in shots]], [[n, *map(float, row)] for n, row in
                                                        zip(names, table)]
