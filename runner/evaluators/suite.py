"""What the evaluators of one run share: the model, its parameters, the datasets and how to read
them, where to write, and the main prediction pass that other evaluators may ride along.

`vmoe eval` and `vmoe ensemble` build a `Suite` over the checkpoints' members and the datasets
they name; the training loop builds one over the current parameters and its validation split.
`run` then runs every evaluator the `eval.*` keys enable, in the registry's order
(runner/evaluators/__init__.py), and merges what they measured.
"""
from __future__ import annotations

import dataclasses
import importlib
import pathlib
import sys
from typing import Protocol

import jax

from runner import data
from runner.config.schema import DataConfig
from runner.evaluators import REGISTRY, predictions


@dataclasses.dataclass
class Dataset:
  """A dataset an evaluator reads: its name in eval.*, data config, opened source and split."""
  name: str
  config: DataConfig
  source: data.Source
  split: str


@dataclasses.dataclass
class Result:
  """What one evaluator measured: scalars and lists for summary.json, PNGs (W&B key -> path),
  arrays for predictions.npz."""
  summary: dict = dataclasses.field(default_factory=dict)
  images: dict = dataclasses.field(default_factory=dict)
  arrays: dict = dataclasses.field(default_factory=dict)

  def update(self, other: "Result") -> None:
    self.summary.update(other.summary)
    self.images.update(other.images)
    self.arrays.update(other.arrays)


class PassHook(Protocol):
  """Device-side sums an evaluator adds to the first dataset's prediction pass."""

  def sums(self, records: dict, batch: dict, logits) -> dict:
    """Traced inside the jitted step: `records` are the routing records of the batch
    (runner/models/introspection.py), `batch` holds image, labels and _mask."""

  def update(self, host: dict, out: dict) -> None:
    """Folds one batch's sums (as NumPy) in; `out` is the pass's host dict (labels, mask)."""


class Suite:
  """The shared state of one evaluation (see the module docstring).

  `model` and `params`: one flax model (an ensemble is one model too) and its placed parameters;
  `members`: the checkpoints behind it (runner/tasks/members.py), for what only they know
  (compute, capacity changes; None in training, which runs neither); `datasets`: eval.datasets,
  the first in-distribution; `ood`: eval.ood_datasets.
  """

  def __init__(self, config, *, model, params, placement, batch_size: int, loss: str,
               datasets: list[Dataset], ood: list[Dataset] | None = None, members=None,
               model_configs: list | None = None, mc_samples: int = 0,
               out_dir: str | pathlib.Path, verbose: bool = True, plots: bool = True):
    self.config = config  # the eval.* section
    self.members, self.model, self.params = members, model, params
    # The model config of every model the prediction is made of (one per checkpoint), and the
    # MC-dropout samples of one: what evaluators that look inside the models need.
    self.model_configs = list(model_configs or [c.config for c in members.checkpoints])
    self.mc_samples = mc_samples if members is None else members.mc_samples
    self.placement, self.batch_size, self.loss_name = placement, batch_size, loss
    self.datasets, self.ood = datasets, list(ood or [])
    self.out_dir = pathlib.Path(out_dir)
    self.verbose, self.plots = verbose and jax.process_index() == 0, plots
    self.step = jax.jit(predictions.make_predict_step(model))
    self.hooks: dict[str, PassHook] = {}  # evaluator name -> its hook on the first main pass
    self.shared: dict = {}  # what an evaluator leaves for later ones (e.g. the pass's speed)

  @property
  def in_distribution(self) -> Dataset:
    return self.datasets[0]

  def say(self, text: str) -> None:
    if self.verbose:
      print(text, file=sys.stderr, flush=True)

  def batches(self, dataset: Dataset, split: str | None = None, pp: str | None = None):
    return data.eval_batches(dataset.source, split or dataset.split, pp or dataset.config.pp,
                             self.batch_size // jax.process_count(),
                             process_index=jax.process_index(),
                             process_count=jax.process_count(), cache=False)

  def evaluate(self, batches, stats, what: str, step=None, on_batch=None) -> float:
    """One pass feeding `stats`; returns images/s (after the first batch)."""
    rate = predictions.run_pass(step or self.step, self.params, batches, stats,
                                put=self.placement.put, on_batch=on_batch)
    self.say(f"[eval] {what}: {stats.count} images, {rate:.0f} images/s")
    return rate

  def hooked_step(self):
    """The prediction step with every hook's sums (the first dataset's main pass)."""
    if not self.hooks:
      return self.step
    return jax.jit(predictions.make_predict_step(self.model, hooks=dict(self.hooks)))

  def feed_hooks(self, out: dict) -> None:
    for name, hook in self.hooks.items():
      hook.update(out["hooks"][name], out)

  def hook_pass(self, name: str) -> None:
    """A pass over the in-distribution dataset for one evaluator's hook alone (when no main
    pass ran, as in training, where the loop evaluates classification itself)."""
    hook = self.hooks[name]
    step = jax.jit(predictions.make_predict_step(self.model, hooks={name: hook}))
    ds = self.in_distribution
    rate = predictions.run_pass(step, self.params, self.batches(ds), None,
                                put=self.placement.put,
                                on_batch=lambda out: hook.update(out["hooks"][name], out))
    self.say(f"[eval] {name} on {ds.name}/{ds.split}: {rate:.0f} images/s")

  def path(self, name: str) -> str:
    self.out_dir.mkdir(parents=True, exist_ok=True)
    return str(self.out_dir / name)


class Evaluator:
  """One measurement: a module under runner/evaluators with a class derived from this one, the
  eval.* keys it reads, and a line in the registry (runner/evaluators/__init__.py)."""
  name = ""

  def __init__(self, suite: Suite):
    self.suite = suite

  @classmethod
  def enabled(cls, config) -> bool:
    """Whether the eval.* section `config` asks for this measurement."""
    raise NotImplementedError

  def hook(self) -> PassHook | None:
    """Sums to add to the first dataset's main pass (None: the evaluator reads on its own)."""
    return None

  def run(self) -> Result:
    raise NotImplementedError


def evaluator_class(name: str) -> type[Evaluator]:
  return importlib.import_module(f"runner.evaluators.{REGISTRY[name]}").Evaluator


def run(suite: Suite, names: list[str] | None = None, skip: tuple[str, ...] = ()) -> Result:
  """Runs the enabled evaluators (or just `names`) in registry order; hooks are collected first
  so that they ride along the first main pass."""
  chosen = [n for n in REGISTRY if (names is None or n in names) and n not in skip]
  evaluators = [evaluator_class(n)(suite) for n in chosen
                if evaluator_class(n).enabled(suite.config)]
  suite.hooks = {}
  for ev in evaluators:
    hook = ev.hook()
    if hook is not None:
      suite.hooks[ev.name] = hook
  result = Result()
  for ev in evaluators:
    result.update(ev.run())
  return result
