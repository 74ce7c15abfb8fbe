"""Steps every task takes: join the job, check the config against the devices, open data, write the
config (and what it ran on) next to the results."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import jax
import yaml

from runner import data, parallel
from runner.checkpoints import checkpoint
from runner.config import as_dict, derived, validate
from runner.config.schema import DataConfig, ModelConfig
from runner.models import transfer
from runner.stages import environment
from runner.train import state as state_lib


def model_of(config) -> ModelConfig:
  """The model a task runs (the first member's, for few-shot over several checkpoints)."""
  return config.model if hasattr(config, "model") else config.members[0].model


def start(config, stage: str, *, check_devices: bool = True) -> parallel.Placement:
  """Joins the multi-host job, says what it runs on, checks what depends on the devices (unless
  the CLI did, in this process), and builds the mesh."""
  d = config.distributed
  parallel.initialize(d.coordinator_address, d.num_processes, d.process_id, auto=d.auto,
                      timeout_seconds=d.timeout_seconds)
  if jax.process_index() == 0:
    if config.logger.progress:  # stdout: a refused stage's stderr is its one paragraph
      print(f"[{stage}] on {environment.devices()}", flush=True)
    fallback = environment.gpu_not_found()
    if fallback:
      print(f"warning: {fallback}.", file=sys.stderr, flush=True)
  # What needs no devices was checked before launch (runner/command/preflight.py); here, what does.
  if check_devices:
    validate(config, devices=jax.device_count(), device_checks_only=True)
  return parallel.placement(config.mesh.data, config.mesh.expert,
                            parallel.logical_rules(config.sharding.name, config.sharding.rules),
                            num_experts=derived.num_experts(model_of(config)))


def write_config(config, workdir: str) -> None:
  if jax.process_index():
    return  # one writer for the shared workdir
  path = pathlib.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.yaml").write_text(yaml.safe_dump(as_dict(config), sort_keys=False))
  environment.write(path)


def open_data(d: DataConfig) -> tuple[DataConfig, data.Source]:
  """Opens the dataset; a missing eval split becomes a held-out slice of the train split. Returns
  the data config with the splits actually used, so they are stored with the checkpoint."""
  source = data.open_source(d.name, data_dir=d.data_dir, root=d.root, image_key=d.image_key,
                            label_key=d.label_key, skip_unreadable=d.skip_unreadable,
                            text_key=d.text_key)
  source.num_examples(d.split)  # raises with the valid splits
  if d.label_noise and source.multilabel:
    raise data.DataError(f"data.label_noise={d.label_noise} replaces a label by a random class, "
                         f"but dataset {d.name!r} is multi-label; use a single-label dataset.")
  split, eval_split, test_split = d.split, d.eval_split, d.test_split
  if not source.has_split(eval_split):
    if split not in source.splits:
      raise data.DataError(f"dataset {d.name!r} has no split {eval_split!r}; set "
                           f"data.eval_split to one of {sorted(source.splits)} or a slice.")
    n = source.num_examples(split)
    held = min(n - 1, max(1, round(n * d.holdout_fraction)))
    split, eval_split = f"{split}[:{n - held}]", f"{split}[{n - held}:]"
  if test_split and not source.has_split(test_split):
    test_split = None
  return dataclasses.replace(d, split=split, eval_split=eval_split, test_split=test_split), source


def check_params_fit(path: str, step: int, params, model, image_shape, command: str) -> None:
  """The restored parameters have the shapes the (possibly overridden) model expects."""
  abstract, _ = state_lib.abstract_params(model, image_shape)
  want, have = transfer.flatten(abstract), transfer.flatten(params)
  problems = [f"{name}: checkpoint {tuple(have[name].shape) if name in have else 'missing'} vs "
              f"model {tuple(target.shape)}" for name, target in want.items()
              if name not in have or tuple(have[name].shape) != tuple(target.shape)]
  problems += [f"{name}: not in the model" for name in have if name not in want]
  if problems:
    more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
    shown = "; ".join(problems[:4]) + more
    raise checkpoint.CheckpointError(
        f"checkpoint {path} (step {step}) does not fit its model with the given model.* keys "
        f"({shown}). In vmoe {command}, model.* may change inference settings (the router's k, "
        "capacity and priority, model.dtype), not the architecture (sizes, experts, a Soft "
        "MoE's slots).")
