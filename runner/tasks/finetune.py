"""`vmoe finetune`: start from an earlier stage's checkpoint, map its parameters, train on new data.

Mapping rules (runner.models.transfer): a new zero-initialised head, position embeddings resized
for a new resolution, optionally experts copied from a dense checkpoint's MLPs. Without
init.checkpoint it trains from scratch with the fine-tuning recipe (a baseline).
"""
from __future__ import annotations

from runner.tasks import common
from runner.train.loop import train_and_evaluate


def run(cfg, workdir: str) -> dict:
  config = common.plain_config(cfg, workdir)
  common.check_training(config)
  common.check_init_path(config, workdir)
  source = common.open_data(config["data"])
  model = common.build_checked_model(config["model"], source.num_classes)
  init_params = common.init_from_checkpoint(config, model, source, workdir)
  common.write_config(config, workdir)
  return train_and_evaluate(config, model=model, source=source, workdir=workdir,
                            init_params=init_params, stage="finetune")
