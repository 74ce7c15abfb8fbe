"""`vmoe fewshot init.checkpoint=<run>`: linear few-shot accuracy of frozen pre-logit features
(docs/fewshot.md). Several checkpoints (init.checkpoint=[runs/a,runs/b]) are probed as one
representation, their pre-logits concatenated, so they must preprocess images alike."""
from __future__ import annotations

import functools
import pathlib

import jax

from runner import data
from runner.checkpoints import weights
from runner.config import as_dict, derived
from runner.config.schema import FewshotRun, Objective
from runner.evaluators.fewshot import (FewshotEvaluator, accuracy_table, format_table,
                                       make_feature_fn, plot_accuracy_vs_shots)
from runner.logging import MetricWriter, environment, say
from runner.models import build_model, heads
from runner.parallel import Placement
from runner.datasets import fewshot_data
from runner.stages import setup
from runner.train import state as state_lib

PLOT = "fewshot_accuracy.png"


def run(config: FewshotRun, placement: Placement, checkpoints: weights.Checkpoints) -> dict:
  fewshot, base, workdir = config.fewshot, config.data, config.workdir
  verbose = config.logger.progress
  batch_size = derived.fewshot_batch_size(fewshot, base)
  opened = fewshot_data.open_datasets(fewshot, base)
  first = next(iter(opened.values()))
  image_shape = data.image_shape(first.source, first.test_split, base.pp)

  members = []
  for member in config.members:
    params, _, step = checkpoints.open(member.path).load(
        ensemble_size=derived.ensemble_size(member.model))
    if member.objective == Objective.contrastive:  # its image tower: no head, the pre-logits
      params, model = params["image"], build_model(member.model, 0)
    else:
      model = build_model(member.model, heads.num_classes(params))
    setup.check_params_fit(member.path, step, params, model, image_shape, "fewshot")
    members.append((member.path, step, model, params))
  environment.write_config(config, workdir)
  for name, f in opened.items():
    say(f"[fewshot] {name}: {f.source.num_classes} classes, pool {f.train_split} "
        f"({f.num_train} images, smallest class {int(f.class_counts.min())}), test "
        f"{f.test_split} ({f.num_test} images)", verbose)
  say("[fewshot] features of " + " + ".join(
      f"{member.model.name} ({path}, step {step})"
      for (path, step, _, _), member in zip(members, config.members))
      + f"; shots {fewshot.shots}, seeds {fewshot.seeds} -> {workdir}", verbose)

  with placement.context():
    feature_fns = []
    for _, _, model, params in members:
      _, logical = state_lib.abstract_params(model, image_shape)
      placed = jax.device_put(params, placement.shardings(logical))
      feature_fns.append(functools.partial(jax.jit(make_feature_fn(model)), placed))
    metrics = FewshotEvaluator(feature_fns, fewshot_data.batches(opened, batch_size, cache=False),
                               shots=fewshot.shots, seeds=fewshot.seeds, l2_regs=fewshot.l2_regs,
                               put=placement.put, progress=verbose, protocol=fewshot.protocol).run()

  step = members[0][1]
  paths = [m.path for m in config.members]
  summary = {"checkpoint": paths[0] if len(paths) == 1 else paths,
             "checkpoint_step": step if len(members) == 1 else [m[1] for m in members]}
  for name, f in opened.items():
    summary.update({f"{name}/train_split": f.train_split, f"{name}/test_split": f.test_split,
                    f"{name}/num_train": f.num_train, f"{name}/num_test": f.num_test,
                    f"{name}/num_classes": f.source.num_classes})
  summary.update(metrics)
  with MetricWriter(workdir, run_config=as_dict(config), wandb=config.logger.wandb,
                    job_type="fewshot") as writer:
    writer.write(step, metrics)
    writer.summary(summary)
    if jax.process_index() == 0:
      title = " + ".join(f"{m.model.name} (step {s})"
                         for m, (_, s, _, _) in zip(config.members, members))
      plot = plot_accuracy_vs_shots(metrics, str(pathlib.Path(workdir) / PLOT),
                                    title=f"linear few-shot: {title}")
      writer.log_image(step, "fewshot/accuracy_vs_shots", plot)
      names, shots, table = accuracy_table(metrics)  # a row per dataset, a column per shots
      writer.log_table("fewshot/accuracy", ["dataset", *[f"{s}shot" for s in shots]],
                       [[n, *map(float, row)] for n, row in zip(names, table)])
      print(format_table(metrics))
  return summary
