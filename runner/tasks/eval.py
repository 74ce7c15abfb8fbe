"""`vmoe eval init.checkpoint=<run>`: every measurement of the papers on one checkpoint
(docs/evaluation.md); everything that can be checked is checked before the first forward pass.
`evaluate`, shared with `vmoe ensemble`, measures "the members' prediction": one model, or several
(their mean probability, with each member's metrics and their diversity)."""
from __future__ import annotations

import pathlib

import jax
import numpy as np

from runner import data
from runner.checkpoints import weights
from runner.config import as_dict, derived
from runner.config.schema import EvalRun, Objective
from runner.errors import ConfigError
from runner.evaluators import EVALUATORS, suite as suite_lib
from runner.logging import MetricWriter, environment
from runner.parallel import Placement
from runner.datasets import dataset_specs
from runner.inference import members as members_lib, zero_shot


def run(config: EvalRun, placement: Placement, checkpoints: weights.Checkpoints) -> dict:
  opened = checkpoints.open(config.init.checkpoint)
  if config.objective.name == Objective.contrastive:  # two towers: a zero-shot classifier
    members, only, summary = zero_shot.load(config, opened)
    return evaluate(config, members, placement, job_type="eval", extra_summary=summary, only=only)
  members = members_lib.load([(opened, config.model)], output=derived.model_output(config.loss))
  partitioned = {"ensemble/type": "pbe"} if members.size > 1 else None
  return evaluate(config, members, placement, job_type="eval", extra_summary=partitioned)


def evaluate(config, members: members_lib.Members, placement: Placement, *, job_type: str,
             extra_summary: dict | None = None, only: tuple[str, ...] | None = None) -> dict:
  """Every measurement `config.eval` enables (runner/evaluators) on the members' prediction (`only`:
  just these evaluators); summary.json, predictions.npz on request, PNGs and the W&B run."""
  d, e = config.data, config.eval
  workdir = config.workdir
  num_classes = members.num_classes

  # What each enabled evaluator needs of the datasets (zero-shot evaluation checked its own).
  if only is None:
    configs = {name: dataset_specs.dataset_config(name, d) for name in (e.datasets or [d.name])}
    for _, cls in EVALUATORS.items():
      if cls.enabled(e):
        cls.check_datasets(e, configs)
  # Every dataset is opened (and its splits and classes checked) before any compute.
  datasets = [dataset_specs.open_dataset(name, d, e.split) for name in (e.datasets or [d.name])]
  for ds in datasets:
    if ds.source.num_classes != num_classes:
      role = " (the in-distribution side of OOD detection)" if e.ood_datasets else ""
      raise ConfigError(f"eval dataset {ds.name!r}{role} has {ds.source.num_classes} classes but "
                        f"the checkpoint's head predicts {num_classes}; evaluate on datasets with "
                        "the same label space (OOD datasets go in eval.ood_datasets).")
  ood = [dataset_specs.open_dataset(name, d, None) for name in e.ood_datasets]
  in_dist = datasets[0]
  if ood and in_dist.source.num_examples(in_dist.config.split) == 0:
    raise data.DataError(f"the training split {in_dist.config.split!r} of {in_dist.name!r} "
                         "(needed for the Mahalanobis fit) is empty.")

  image_shape = data.image_shape(in_dist.source, in_dist.split, in_dist.config.pp)
  members.check_fit(image_shape, job_type)
  environment.write_config(config, workdir)
  pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
  steps = members.steps
  summary: dict = {"checkpoint_step": steps[0] if len(steps) == 1 else steps,
                   "split": in_dist.split, **(extra_summary or {})}
  if members.size > 1 or "ensemble/type" in (extra_summary or {}):
    summary["ensemble/size"] = members.size
  with placement.context():
    suite = suite_lib.Suite(e, members=members, model=members.model(), placement=placement,
                            params=members.place(placement, image_shape), loss=config.loss.value,
                            batch_size=derived.eval_batch_size(e, d), datasets=datasets, ood=ood,
                            out_dir=workdir, verbose=config.logger.progress, plots=e.plots)
    result = suite_lib.run(suite, names=list(only) if only else None)
  summary.update(result.summary)
  if result.arrays and jax.process_index() == 0:
    np.savez_compressed(pathlib.Path(workdir) / "predictions.npz", **result.arrays)
  _write_outputs(config, workdir, job_type, steps[0], summary, result.images)
  # One metric per line (per-severity values stay in summary.json).
  keys = [k for k, v in summary.items() if isinstance(v, float) and "/sev_" not in k]
  width = max((len(k) for k in keys), default=0)
  print("\n".join(f"{k:<{width}}  {summary[k]:.4f}" for k in keys))
  return summary


def _write_outputs(config, workdir, job_type, step, summary, images) -> None:
  with MetricWriter(workdir, run_config=as_dict(config), wandb=config.logger.wandb,
                    job_type=job_type) as writer:
    scalars = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
    writer.write(step, scalars)
    for key, path in images.items():
      writer.log_image(step, key, path)
    writer.log_table("eval/summary", ["metric", "value"], sorted(scalars.items()))
    writer.summary(summary)
