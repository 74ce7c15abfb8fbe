"""Steps every stage takes: join the job, check the config against the devices and build the mesh;
check that restored parameters fit their model."""
from __future__ import annotations

import sys

import jax

from runner import parallel
from runner.checkpoints import checkpoint
from runner.config import derived, validate
from runner.config.schema import ModelConfig
from runner.logging import environment
from runner.models import transfer
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
    if fallback := environment.gpu_not_found():
      print(f"warning: {fallback}.", file=sys.stderr, flush=True)
  # What needs no devices was checked before launch (runner/command/preflight.py); here, what does.
  if check_devices:
    validate(config, devices=jax.device_count(), device_checks_only=True)
  return parallel.placement(config.mesh.data, config.mesh.expert,
                            parallel.logical_rules(config.sharding.name, config.sharding.rules),
                            num_experts=derived.num_experts(model_of(config)))


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
