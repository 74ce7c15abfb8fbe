"""`vmoe ensemble init.checkpoint=[runs/a,runs/b]`: checkpoints evaluated as one ensemble.

The prediction is the mean of the members' probabilities (never of their logits); the type (pbe,
down-DE, up-DE, mc-dropout, mixed: docs/ensembles.md) is read from the members' stored configs."""
from __future__ import annotations

import os

from runner.checkpoints import checkpoint, weights
from runner.config import derived
from runner.config.schema import EnsembleRun
from runner.parallel import Placement
from runner.inference import members as members_lib
from runner.tasks.eval import evaluate


def _origin(path: str | None, checkpoints: weights.Checkpoints):
  """A checkpoint path as (directory, step), however it was written (runs/up, ./runs/up/,
  runs/up/checkpoints/20); the normalised path for a released checkpoint or one not found."""
  if path is None:
    return None
  try:
    opened = checkpoints.open(path)
  except checkpoint.CheckpointError:
    opened = None
  if opened is None or opened.released:
    return os.path.normpath(os.path.abspath(path))
  return str(opened.directory.resolve()), opened.step


def ensemble_type(config: EnsembleRun, checkpoints: weights.Checkpoints) -> str:
  members = config.members
  if config.ensemble.mc_dropout:
    return "mc-dropout"
  if any(derived.predictions_per_image(m.model) > 1 for m in members):
    return "pbe" if len(members) == 1 else "mixed"
  upstreams = [_origin(m.upstream, checkpoints) for m in members]
  if all(m.stage == "finetune" for m in members) and None not in upstreams and len(
      set(upstreams)) == 1:
    return "down-DE"
  one_stage = len({m.stage for m in members}) == 1
  independent = len(set(upstreams)) == len(upstreams) or all(u is None for u in upstreams)
  own = {_origin(m.path, checkpoints) for m in members}
  if one_stage and independent and not own & set(upstreams):
    return "up-DE"
  return "mixed"


def run(config: EnsembleRun, placement: Placement, checkpoints: weights.Checkpoints) -> dict:
  members = members_lib.load([(checkpoints.open(m.path), m.model) for m in config.members],
                             output=derived.model_output(config.loss),
                             mc_samples=config.ensemble.mc_dropout, seed=config.seed)
  return evaluate(config, members, placement, job_type="ensemble",
                  extra_summary={"ensemble/type": ensemble_type(config, checkpoints),
                                 "checkpoint": [m.path for m in config.members]})
