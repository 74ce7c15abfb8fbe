"""A small subcommand, `vmoe params`, as docs/extending.md adds one: its record, its task function
and (written by the test) its conf file. It counts the parameters of the configured model without
training it; its main metric is that count."""
from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp

from runner.config import subcommands
from runner.config.schema import TrainTask
from runner.models import build_model


def run(config: TrainTask, placement, checkpoints) -> dict:
  """`run(config, placement, checkpoints) -> summary`, as every stage's task function."""
  del placement, checkpoints  # one process, no checkpoint read
  size = config.model.image_size
  model = build_model(config.model, num_classes=10)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, 3)))
  count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes["params"]))
  summary = {"params/count": count}
  folder = pathlib.Path(config.workdir)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "summary.json").write_text(json.dumps(summary))
  return summary


subcommands.register(subcommands.Subcommand(
    "params", "the parameter count of a model, without training it", __name__, TrainTask,
    main_metric="params/count", metric=lambda s: float(s["params/count"]), resolver="train_task",
    wrote=lambda s: "params/count" in s, columns=lambda s: [("parameters", "params/count", 0)],
    has_run_page=False))
