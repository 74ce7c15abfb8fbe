"""What must fit once a training run's data is open: its batch and its training split, its
schedule and the steps that split gives (train.epochs). Checked before anything is written or
compiled; the config alone (runner/config/relations.py) checks what needs no data."""
from __future__ import annotations

import jax

from runner import data
from runner.config import relations
from runner.config.schema import TrainTask
from runner.errors import ConfigError
from runner.logging import say
from runner.train import schedules
from runner.train.loop import total_steps

# Each stage's recipe sets its own batch (conf/<stage>.yaml), which a small dataset meets first.
RECIPE_BATCHES = "the pretrain recipe's default is 128, finetune's 64"


def _largest_batch(config: TrainTask, examples: int, shards: int) -> int | None:
  """The largest data.batch_size the split can give that also splits over the shards, the
  devices, the micro-batches and the routing groups (relations.batch_problem), or None."""
  devices = jax.device_count()
  for size in range(examples * shards, 0, -1):
    if size % shards == 0 and size // shards <= examples and relations.batch_problem(
        size, "data.batch_size", config.model, devices, config.train.accum_steps) is None:
      return size
  return None


def _split_said(config: TrainTask, split: str, source: data.Source) -> str:
  """The training split, and the part held out of it for validation (a dataset without one)."""
  asked = config.data.split
  said = f"split {split!r} of {source.name!r}"
  if split != asked and split.startswith(f"{asked}["):
    total = source.num_examples(asked)
    held = total - source.num_examples(split)
    said += (f" ({held} of the {total} examples of {asked!r} are held out for validation, "
             f"data.holdout_fraction={config.data.holdout_fraction:g})")
  return said


def check_batch_fits_the_split(config: TrainTask, split: str, source: data.Source) -> None:
  """Every step takes a whole batch from each shard of the training split (the stream drops no
  remainder into a short batch), so a shard must hold at least its part of one batch."""
  d = config.data
  shards = d.num_shards or jax.process_count()
  examples = source.num_examples(split)
  per_shard, part = examples // shards, d.batch_size // shards
  if per_shard >= part:
    return
  largest = _largest_batch(config, per_shard, shards)
  sharded = (f" read in data.num_shards={shards} shards of {per_shard} examples, each giving "
             f"{part} images of every batch," if shards > 1 else "")
  fix = f"Use data.batch_size={largest} or less" if largest else "Use a smaller data.batch_size"
  raise data.DataError(
      f"data.batch_size={d.batch_size} is larger than the training data: "
      f"{_split_said(config, split, source)} has {examples} examples{sharded} and every step "
      f"trains on a whole batch. {fix} ({RECIPE_BATCHES}), or train on more data.")


def check_schedule_fits_the_run(config: TrainTask, split: str, source: data.Source) -> int:
  """The run's steps (train.steps, or train.epochs over the split) against the warm-up: a run
  that cannot follow its schedule is refused (the relation checked train.steps already), one that
  spends most of itself warming up is said in one line. Returns the steps."""
  t, d = config.train, config.data
  examples = source.num_examples(split)
  steps = total_steps(t.steps, t.epochs, examples, d.batch_size)
  length = (f"train.steps={t.steps}" if t.steps else
            f"train.epochs={t.epochs:g} = {steps} steps of data.batch_size={d.batch_size} over "
            f"{examples} examples")
  if problem := schedules.warmup_problem(config.schedule, config.optim, steps, length):
    raise ConfigError(problem)
  if warning := schedules.warmup_warning(config.schedule, steps, length):
    say(f"warning: {warning}")
  return steps
