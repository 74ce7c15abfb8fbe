"""`vmoe pretrain`: train a ViT / V-MoE upstream, from scratch or from init.checkpoint.

Rerunning in the same workdir resumes. Defaults (conf/pretrain.yaml): the embedded MNIST-5k,
Adam, linear decay.
"""
from __future__ import annotations

from runner.tasks.common import run_training


def run(cfg, workdir: str) -> dict:
  return run_training(cfg, workdir, stage="pretrain")
