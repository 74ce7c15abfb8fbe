"""`vmoe finetune`: start from an earlier stage's checkpoint, map its parameters
(runner.models.transfer), train on new data; without init.checkpoint, train from scratch with the
fine-tuning recipe (conf/finetune.yaml), a baseline."""
from __future__ import annotations

from runner.training.run import run_training


def run(config, placement, checkpoints) -> dict:
  return run_training(config, placement, checkpoints, stage="finetune")
