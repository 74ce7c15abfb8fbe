"""The compute path imports where an accelerator image has jax, flax, optax and numpy but no
TensorFlow, TFDS, Hydra, OmegaConf or W&B: the models, the train and eval steps, the schemas they
take, and the GPU benchmark. The `compute-path` contract in pyproject.toml checks the imports
that import-linter sees; this test also runs each package's __init__, as Python does."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from omegaconf import MISSING

from runner.config import schema

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABSENT = ("tensorflow", "tensorflow_datasets", "hydra", "omegaconf", "wandb")

# Every module of runner.models, runner.train and runner.losses, but the PyTorch sources that
# `vmoe export` copies into its modeling file (they use that file's names and are never imported),
# the training loop, which feeds the steps from tf.data, and what a run starts from, which reads
# checkpoints and their configs.
_IMPORT_EVERYTHING = f"""
import importlib, pkgutil, sys
for name in {ABSENT!r}:
  sys.modules[name] = None  # `import name` now raises ImportError
import runner.config.schema, runner.losses, runner.models, runner.train
from runner.train.step import make_eval_step, make_train_step
import benchmarks.gpu, benchmarks.train_step
for package in (runner.models, runner.train, runner.losses):
  for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    if not module.name.endswith("_torch") and module.name not in ("runner.train.loop",
                                                                  "runner.train.start"):
      importlib.import_module(module.name)
"""


def test_the_compute_path_imports_without_tensorflow_hydra_omegaconf_or_wandb():
  result = subprocess.run([sys.executable, "-c", _IMPORT_EVERYTHING], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]


def test_the_schemas_missing_value_is_omegaconfs():
  """Hydra and OmegaConf read "???" as a mandatory value without one: the schema's own marker
  must stay that string for `vmoe` to say which key needs a value."""
  assert schema.MISSING == MISSING
  assert schema.ModelConfig.name == MISSING
