"""What the evaluators of one run share: the model, its parameters, the datasets and how to read
them, where to write, and the main prediction pass that other evaluators may ride along. `vmoe
eval`, `vmoe ensemble` and the training loop each build a `Suite`; `run` runs every evaluator the
`eval.*` keys enable, in registration order, and merges what they measured."""
from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
import types
import typing
from typing import Callable, Protocol

import jax

from runner import data
from runner.config import components
from runner.config.registries import EVALUATORS
from runner.config.schema import DataConfig, EvalSuiteConfig
from runner.config.sections import default_of, fields_of
from runner.evaluators import predictions
from runner.models import compiler_options


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


# What an evaluator reads on the host from each batch of every dataset's main pass: the dataset
# and the pass's host dict (logits, pre_logits, member_logits for an ensemble, labels, mask).
Reader = Callable[["Dataset", dict], None]


class Suite:
  """The shared state of one evaluation (see the module docstring). `model` and `params`: one flax
  model (an ensemble is one model too) and its placed parameters; `members`: the checkpoints behind
  it (runner/inference/members.py), for what only they know (compute, capacity changes; None in
  training, which runs neither); `datasets`: eval.datasets, the first in-distribution; `ood`:
  eval.ood_datasets."""

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
    # What every program of these models is compiled with (cuDNN's grouped matmul, if chosen).
    self.compiler_options = {key: value for c in self.model_configs
                             for key, value in compiler_options(c).items()} or None
    self.step = self.jit(predictions.make_predict_step(model))
    self.hooks: dict[str, PassHook] = {}  # evaluator name -> its hook on the first main pass
    self.readers: dict[str, Reader] = {}  # evaluator name -> its reader of every main pass
    self.read: set[str] = set()  # the datasets whose main pass the readers have seen
    self.shared: dict = {}  # what an evaluator leaves for later ones (e.g. the pass's speed)
    self.warned: set[str] = set()

  @property
  def in_distribution(self) -> Dataset:
    return self.datasets[0]

  def jit(self, fn: Callable) -> Callable:
    """`jax.jit` with the models' compiler options: what evaluators compile their passes with."""
    return jax.jit(fn, compiler_options=self.compiler_options)

  def say(self, text: str) -> None:
    if self.verbose:
      print(text, file=sys.stderr, flush=True)

  def warn(self, text: str) -> None:
    """What a measurement's reader must know, said once even when the suite runs quietly (the
    evaluations of training)."""
    if jax.process_index() == 0 and text not in self.warned:
      self.warned.add(text)
      print(f"warning: {text}.", file=sys.stderr, flush=True)

  def batches(self, dataset: Dataset, split: str | None = None, pp: str | None = None,
              text: data.TextSpec | None = None):
    return data.eval_batches(dataset.source, split or dataset.split, pp or dataset.config.pp,
                             self.batch_size // jax.process_count(),
                             process_index=jax.process_index(),
                             process_count=jax.process_count(), cache=False, text=text)

  def evaluate(self, batches, stats, what: str, step=None, on_batch=None) -> float:
    """One pass feeding `stats`; returns images/s (after the first batch)."""
    rate = predictions.run_pass(step or self.step, self.params, batches, stats,
                                put=self.placement.put, on_batch=on_batch)
    self.say(f"[eval] {what}: {stats.count} images, {rate:.0f} images/s")
    return rate

  def main_pass(self, dataset: Dataset, stats, *, first: bool) -> float:
    """Classification's pass over `dataset`, which others ride instead of passing again: the
    hooks the first dataset's, the readers every dataset's. Returns images/s."""
    hooked = first and bool(self.hooks)
    step = (self.jit(predictions.make_predict_step(self.model, hooks=dict(self.hooks))) if hooked
            else None)

    def on_batch(out):
      if hooked:
        for name, hook in self.hooks.items():
          hook.update(out["hooks"][name], out)
      for read in self.readers.values():
        read(dataset, out)
    rate = self.evaluate(self.batches(dataset), stats, f"{dataset.name}/{dataset.split}",
                         step=step, on_batch=on_batch)
    self.read.add(dataset.name)
    return rate

  def hook_pass(self, name: str) -> None:
    """A pass over the in-distribution dataset for one evaluator's hook alone (when no main
    pass ran, as in training, where the loop evaluates classification itself)."""
    hook = self.hooks[name]
    step = self.jit(predictions.make_predict_step(self.model, hooks={name: hook}))
    ds = self.in_distribution
    rate = predictions.run_pass(step, self.params, self.batches(ds), None, put=self.placement.put,
                                on_batch=lambda out: hook.update(out["hooks"][name], out))
    self.say(f"[eval] {name} on {ds.name}/{ds.split}: {rate:.0f} images/s")

  def reader_passes(self, name: str) -> None:
    """Passes over the datasets no main pass fed to evaluator `name`'s reader (in training,
    where the loop evaluates classification itself, every dataset)."""
    read = self.readers[name]
    for ds in [d for d in self.datasets if d.name not in self.read]:
      rate = predictions.run_pass(self.step, self.params, self.batches(ds), None,
                                  put=self.placement.put, on_batch=lambda out, ds=ds: read(ds, out))
      self.say(f"[eval] {name} on {ds.name}/{ds.split}: {rate:.0f} images/s")

  def path(self, name: str) -> str:
    self.out_dir.mkdir(parents=True, exist_ok=True)
    return str(self.out_dir / name)


class Evaluator:
  """One measurement, registered with `register`: the built-in ones in
  runner/evaluators/__init__.py, a plug-in's in its own module. The class declares its keys
  (`Config`, a section eval.<section>.*; `Keys`, keys of eval.* itself) and where it applies, and
  the training loop, zero-shot evaluation and the config's relations ask these attributes instead
  of naming evaluators (docs/extending.md)."""
  name = ""  # its name in messages and --help, and its section of eval.* unless `section` says
  # The eval.* key that turns it on, named in error messages ("": always on, as classification);
  # `enabled` reads it unless the class says otherwise.
  enabling_key = ""
  in_training = True  # runs on the validation split in pretrain/finetune, every eval.every_steps
  on_contrastive = True  # measures a contrastive checkpoint evaluated as a zero-shot classifier
  on_classifier = True  # measures a classifier's checkpoint (False: needs a contrastive one)
  needs_labels = True  # False: also measures a dataset without labels (captions alone)
  Config: type | None = None  # a dataclass of its own keys, eval.<section>.*; None: no section
  section = ""  # the name of Config's section ("": `name`), e.g. "routing" for eval.routing.*
  Keys: type | None = None  # a dataclass of keys of eval.* itself, eval.<field>; None: none

  def __init__(self, suite: Suite):
    self.suite = suite

  @classmethod
  def enabled(cls, config) -> bool:
    """Whether the eval.* section `config` asks for this measurement: its key is set."""
    return not cls.enabling_key or bool(cls.setting(config))

  @classmethod
  def setting(cls, config):
    """The value of `enabling_key` in the eval.* section `config`."""
    return functools.reduce(getattr, cls.enabling_key.split(".")[1:], config)

  @classmethod
  def check_datasets(cls, config, datasets: dict[str, DataConfig]) -> None:
    """Raises a UserError when `datasets` (eval name -> data config) cannot be measured; a task
    calls it before loading the checkpoint (zero-shot evaluation, which embeds the classes)."""

  def hook(self) -> PassHook | None:
    """Sums to add to the first dataset's main pass (None: the evaluator reads on its own)."""
    return None

  def reader(self) -> Reader | None:
    """What reads every dataset's main pass on the host, instead of a pass of its own (None:
    nothing); `run` calls `suite.reader_passes(name)` for the datasets no main pass covered."""
    return None

  def run(self) -> Result:
    raise NotImplementedError

  @classmethod
  def report_section(cls, summary: dict, workdir: pathlib.Path) -> tuple[str, str] | None:
    """A section of its own on the run's `vmoe report` page: (title, HTML body) from the run's
    summary.json and workdir, or None (this default: the page's tables and pictures show what
    it wrote). The body is inserted as it is: escape what it reads (html.escape)."""
    return None


def _origin(cls) -> str:
  return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"


def _section(cls) -> str:
  return cls.section or cls.name


def _fields(declared: type | None) -> tuple[dataclasses.Field, ...]:
  return dataclasses.fields(declared) if declared is not None else ()


def _declared_by(f: dataclasses.Field) -> str | None:
  """The evaluator whose registration added key `f` to eval.* (None: eval.*'s own keys)."""
  return f.metadata.get("declared_by")


def _declaration_problem(cls) -> str | None:
  """What keeps `cls` from being registered, in words for the plug-in's author; None if nothing."""
  if not (isinstance(cls, type) and issubclass(cls, Evaluator)):
    return "register a class derived from runner.evaluators.Evaluator"
  if not isinstance(cls.name, str) or not cls.name.isidentifier():
    return (f"its name {cls.name!r} must be a Python identifier (its section eval.<name>.*), "
            "e.g. name = \"per_class_accuracy\"")
  if cls.section and (not isinstance(cls.section, str) or not cls.section.isidentifier()):
    return f"its section {cls.section!r} must be a Python identifier (eval.<section>.*)"
  for what, declared in (("Config", cls.Config), ("Keys", cls.Keys)):
    if declared is not None and not dataclasses.is_dataclass(declared):
      where = f"eval.{_section(cls)}.*" if what == "Config" else "eval.<key>"
      return f"its {what} {declared!r} must be a dataclass (its keys, {where})"
  fields = {name: f for name, (_, f) in fields_of(EvalSuiteConfig).items()}
  own = _origin(cls)
  if cls.Config is not None and _section(cls) in fields and _declared_by(
      fields[_section(cls)]) != own:
    return (f"eval.{_section(cls)} is already a key of eval.*, so its Config cannot be that "
            "section: give the evaluator another " + ("section" if cls.section else "name"))
  taken = [f.name for f in _fields(cls.Keys)
           if f.name in fields and _declared_by(fields[f.name]) != own]
  if taken:
    return (f"its Keys declare {', '.join(f'eval.{k}' for k in taken)}, already a key of eval.*: "
            "give the key another name")
  if cls.enabling_key and not _names_an_eval_key(cls):
    return (f"enabling_key={cls.enabling_key!r} is not a key of eval.* (e.g. "
            f"\"eval.{cls.name}.enabled\" with `enabled: bool = False` in its Config)")
  return None


def _names_an_eval_key(cls) -> bool:
  """Whether `cls.enabling_key` is a key of eval.* once `cls`'s keys are added."""
  if not cls.enabling_key.startswith("eval."):
    return False
  probe = types.SimpleNamespace(**{name: default_of(f)
                                   for name, (_, f) in fields_of(EvalSuiteConfig).items()})
  if cls.Config is not None:
    setattr(probe, _section(cls), cls.Config())
  for f in _fields(cls.Keys):
    setattr(probe, f.name, getattr(cls.Keys(), f.name))
  try:
    cls.setting(probe)
  except AttributeError:
    return False
  return True


def _keys(cls) -> dict[str, tuple[type, dataclasses.Field]]:
  """The fields `cls` adds to eval.*, each marked as its own: its Keys, then its section."""
  hints = typing.get_type_hints(cls.Keys) if cls.Keys is not None else {}
  marked = {"declared_by": _origin(cls)}
  keys = {f.name: (hints[f.name], dataclasses.field(
      default=f.default, default_factory=f.default_factory, metadata={**f.metadata, **marked}))
      for f in _fields(cls.Keys)}
  if cls.Config is not None:
    keys[_section(cls)] = (cls.Config, dataclasses.field(default_factory=cls.Config,
                                                          metadata=marked))
  return keys


# Evaluators are enabled by their keys, not chosen by a name: each brings its keys itself.
KIND = components.Kind(EVALUATORS, EvalSuiteConfig, noun="evaluator", nouns="evaluators",
                       keys=_keys)


def register(cls: type[Evaluator]) -> type[Evaluator]:
  """Makes `cls` run wherever its keys enable it, after the evaluators registered before it,
  and adds its keys to the schema (`Keys` as eval.<key>, `Config` as eval.<section>.*); a class
  decorator for a plug-in's module (`plugins=[<module>]` imports it before the config is
  composed)."""
  if problem := _declaration_problem(cls):
    raise TypeError(f"evaluator {_origin(cls)} cannot be registered: {problem}.")
  components.register(KIND, cls.name, cls)
  return cls


def run(suite: Suite, names: list[str] | None = None) -> Result:
  """Runs the enabled evaluators (or just `names`) in registration order; hooks and readers are
  collected first so that they ride along the main passes."""
  chosen = [cls for name, cls in EVALUATORS.items() if names is None or name in names]
  evaluators = [cls(suite) for cls in chosen if cls.enabled(suite.config)]
  suite.hooks, suite.readers, suite.read = {}, {}, set()
  for ev in evaluators:  # each evaluator's hook, then its reader, as a plug-in may rely on
    if (hook := ev.hook()) is not None:
      suite.hooks[ev.name] = hook
    if (reader := ev.reader()) is not None:
      suite.readers[ev.name] = reader
  result = Result()
  for ev in evaluators:
    result.update(ev.run())
  return result
