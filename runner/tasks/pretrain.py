"""`vmoe pretrain`: train a ViT / V-MoE upstream, from scratch or from init.checkpoint (rerunning in
the same workdir resumes). Defaults (conf/pretrain.yaml): embedded MNIST-5k, Adam, linear decay."""
from __future__ import annotations

from runner.training.run import run_training


def run(config, placement, checkpoints) -> dict:
  return run_training(config, placement, checkpoints, stage="pretrain")
