"""`vmoe finetune`: start from an earlier stage's checkpoint, map its parameters, train on new data.

Mapping rules (runner.models.transfer): a new zero-initialised head, position embeddings resized
for a new resolution, optionally experts copied from a dense checkpoint's MLPs. Without
init.checkpoint it trains from scratch with the fine-tuning recipe (a baseline). Defaults
(conf/finetune.yaml): the embedded UCI digits, SGD with momentum, cosine decay, expert dropout.
"""
from __future__ import annotations

from runner.stages.training import run_training


def run(config, placement, checkpoints) -> dict:
  return run_training(config, placement, checkpoints, stage="finetune")
