"""`vmoe pretrain`: train a ViT / V-MoE from scratch (or resume) on the upstream data."""
from __future__ import annotations

from runner.tasks import common
from runner.train.loop import train_and_evaluate


def run(cfg, workdir: str) -> dict:
  config = common.plain_config(cfg, workdir)
  common.check_training(config)
  source = common.open_data(config["data"])
  model = common.build_checked_model(config["model"], source.num_classes)
  common.write_config(config, workdir)
  return train_and_evaluate(config, model=model, source=source, workdir=workdir, stage="pretrain")
