"""pretrain and finetune: the same steps; their configs differ (data, optimizer, head). The data
is opened and checked here, with the datasets of in-training evaluation; what the run starts from
is worked out by runner/train/start.py."""
from __future__ import annotations

import dataclasses

import jax

from runner import data
from runner.checkpoints import checkpoint, weights
from runner.config import derived
from runner.config.schema import Objective, TrainTask
from runner.errors import ConfigError
from runner.parallel import Placement
from runner.datasets import dataset_specs, fewshot_data
from runner.training import contrastive, fit
from runner.train import start as start_lib
from runner.train.loop import train_and_evaluate


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
  data_config, source = data.open_data(config.data)
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
  image_shape = data.image_shape(source, config.data.split, config.data.pp_train)
  begin = start_lib.classifier(config, source.num_classes, image_shape, start, stage, steps)
  return train_and_evaluate(config, start=begin, source=source, placement=placement, stage=stage,
                            fewshot_datasets=fewshot, ood_datasets=ood)
