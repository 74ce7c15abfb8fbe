"""The training loop shared by `pretrain` and `finetune`.

It starts as runner/train/start.py worked out (the model, its plan and its parameters: resumed
from this workdir's newest readable checkpoint > initialised from an earlier stage's > from
scratch). Faults lose at most the steps since the last checkpoint:
- SIGINT/SIGTERM (and SIGUSR1/SIGUSR2, a scheduler's warning) finish the current step, save, and
  exit (128 + signal); a second signal exits at once. Rerunning the same command resumes; a SLURM
  job still running requeues itself and resumes (runner/parallel/preemption.py).
- A non-finite loss or gradient norm stops the run before anything is saved from that state
  (checked one step behind, so the device never waits for the host, and before every save)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import signal
import sys

import jax
import numpy as np

from runner import data
from runner.checkpoints.checkpoint import Checkpointer
from runner.config import as_dict, derived
from runner.config.schema import TrainTask
from runner.errors import Interrupted, RunError
from runner.evaluators import EVALUATORS, suite as suite_lib
from runner.evaluators.classification import ClassificationEvaluator
from runner.evaluators.fewshot import FewshotEvaluator, make_feature_fn
from runner.logging import MetricWriter, Progress, environment, say
from runner.models import compiler_options
from runner.models.size import count_params
from runner.parallel import Placement, preemption
from runner.train import optimizers, schedules
from runner.train.start import Start, initial_state
from runner.train.step import make_eval_step, make_train_step


class Diverged(RunError):
  """The loss or the gradient norm stopped being a finite number."""


def total_steps(steps: int | None, epochs: float | None, num_examples: int, batch_size: int) -> int:
  """train.steps, or train.epochs converted with the split size and batch size."""
  return int(steps) if steps else max(1, math.ceil(epochs * num_examples / batch_size))


class _StopFlag:
  """The first SIGINT/SIGTERM (or SIGUSR1/SIGUSR2, which schedulers send before a preemption or
  a time limit) asks to stop after the current step; a second one exits at once."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

  def __init__(self):
    self.signum, self.previous = None, {}

  def __enter__(self):
    for sig in self.SIGNALS:
      with contextlib.suppress(ValueError):  # not the main thread: signals stay as they are
        self.previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.signum is not None:
      # The last committed checkpoint is intact (Orbax commits by renaming a finished folder).
      print(f"vmoe: second signal ({signal.Signals(signum).name}): exiting now without saving; "
            "rerun the same command to resume from the last checkpoint.", file=sys.stderr,
            flush=True)
      os._exit(128 + signum)
    self.signum = signum

  def __exit__(self, *exc):
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)


class _DivergenceGuard:
  """Fails the run at the first step whose loss or gradient norm is not finite."""

  def __init__(self, checkpointer: Checkpointer, optim, warmup_steps: int):
    self.checkpointer, self.optim, self.warmup_steps = checkpointer, optim, warmup_steps
    self.pending = None  # (step, metrics) dispatched but not yet checked

  def dispatched(self, step: int, metrics: dict) -> None:
    """Checks the previous step (finished by now, so this does not stall the device)."""
    self.check_pending()
    self.pending = (step, metrics)

  def check_pending(self) -> None:
    if self.pending is not None:
      self.check(*self.pending)
      self.pending = None

  def check(self, step: int, metrics: dict) -> None:
    names = ("train/loss", "train/grad_norm")
    values = dict(zip(names, map(float, jax.device_get([metrics[k] for k in names]))))
    if all(math.isfinite(v) for v in values.values()):
      return
    self.checkpointer.wait()
    if (last := self.checkpointer.latest_step()) is not None:
      kept = (f"the last good checkpoint, step {last} in {self.checkpointer.directory}, is kept; "
              "rerunning the same command resumes from it")
    else:
      kept = "no checkpoint had been saved yet, so rerunning starts again from step 0"
    o = self.optim
    clip = (f"optim.grad_clip_norm (now {o.grad_clip_norm})" if o.grad_clip_norm
            else "gradient clipping, optim.grad_clip_norm=1.0 (now off)")
    quantities = ", ".join(f"{k} is {v}" for k, v in values.items())
    raise Diverged(f"training diverged at step {step}: {quantities}. The run stopped and saved "
                   f"nothing from that state; {kept}. Try a lower optim.lr (now {o.lr:g}), {clip}, "
                   f"or a longer warmup (schedule.warmup_steps, now {self.warmup_steps}).")


class _Measurements:
  """The eval.* evaluators that declare `in_training`, on the validation split
  (runner/evaluators); the others are vmoe eval's (a relation refuses their keys here)."""

  def __init__(self, config: TrainTask, model, source, placement: Placement, batch_size: int,
               ood: list):
    d = config.data
    self.names = [name for name, cls in EVALUATORS.items()
                  if cls.in_training and cls.enabled(config.eval)]
    if not self.names:
      return
    val = suite_lib.Dataset(name=d.name, config=d, source=source, split=d.eval_split)
    self.suite = suite_lib.Suite(config.eval, model=model, params=None, placement=placement,
                                 batch_size=batch_size, loss=config.train.loss.value,
                                 datasets=[val], ood=ood, model_configs=[config.model],
                                 out_dir=config.workdir, verbose=False, plots=False)

  def run(self, params, final: bool = False):
    """{"val/<key>": value} of every enabled evaluator (and, at the end, their pictures)."""
    if not self.names:
      return suite_lib.Result()
    self.suite.params, self.suite.plots = params, final and self.suite.config.plots
    result = suite_lib.run(self.suite, names=self.names)
    result.summary = {f"val/{k}": v for k, v in result.summary.items()}
    return result


def _keys(section, *leave_out: str) -> dict:
  return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
          if f.name not in leave_out}


class _Run:
  """One run of the loop: what its set-up builds, the state it trains and the position in its
  data stream, and the parts of each step (train, log, evaluate, save, stop) and of its end."""

  def __init__(self, config: TrainTask, *, start: Start, source, placement: Placement, stage: str,
               pairs=None):
    d, o, s = config.data, config.optim, config.schedule
    self.config, self.model, self.source, self.placement = config, start.model, source, placement
    self.plan, self.stage, self.pairs, self.seed = start.plan, stage, pairs, config.seed
    self.init_params = start.init_params
    self.text = pairs.text if pairs else None  # a contrastive run's captions, tokenized
    self.batch_size, self.steps = d.batch_size, start.plan.steps
    self.eval_batch_size = derived.eval_batch_size(config.eval, d)
    self.processes = dict(process_index=jax.process_index(), process_count=jax.process_count())
    # The schedule and the optimizer read their own keys (their Config's) of these sections.
    self.schedule = schedules.make_schedule(s.name, o.lr, self.steps, **_keys(s, "name"))
    self.abstract, self.logical = start.abstract, start.logical
    self.tx = optimizers.make_optimizer(o.name, self.schedule, self.abstract,
                                        frozen=pairs.frozen if pairs else None,
                                        **_keys(o, "name", "lr"))
    ckpt = config.checkpoint
    self.checkpointer = Checkpointer(os.path.join(config.workdir, "checkpoints"), keep=ckpt.keep,
                                     every_steps=ckpt.every_steps, async_save=ckpt.async_save)
    # What later stages read back: the model, the data, and where the run came from (the
    # ensemble type of `vmoe ensemble` is read from its members' stages and upstream checkpoints).
    self.stored_config = {**as_dict(config), "stage": stage}
    self.progress = self.writer = None

  def start(self, fewshot_datasets: dict | None, ood_datasets: list) -> None:
    """The initial state (resumed, initialised from the start's parameters, or from scratch), the
    writer, the compiled steps, the evaluators and the data stream from the state's position."""
    config, model, placement, t = self.config, self.model, self.placement, self.config.train
    self.state, shardings, self.position, origin = initial_state(
        self.checkpointer, model=model, tx=self.tx, image_shape=self.plan.image_shape,
        placement=placement, seed=self.seed, init_params=self.init_params, warn=say,
        abstract=(self.abstract, self.logical))
    self.writer = MetricWriter(config.workdir, run_config=self.stored_config,
                               wandb=config.logger.wandb, job_type=self.stage)
    train_step = make_train_step(
        model, self.tx, self.schedule, loss=t.loss.value, aux_loss_weight=t.aux_loss_weight,
        accum_steps=t.accum_steps, seed=self.seed, param_updates=self.plan.param_updates,
        objective=self.pairs.objective if self.pairs else None)
    options = compiler_options(config.model) or None  # cuDNN's grouped matmul, if chosen
    self.step_fn = jax.jit(train_step, in_shardings=(shardings, placement.batch_sharding),
                           out_shardings=(shardings, None), donate_argnums=0,
                           compiler_options=options)
    self.eval_step = None if self.pairs else jax.jit(make_eval_step(model, t.loss.value),
                                                     compiler_options=options)
    self.val = self.evaluator(config.data.eval_split, "val")
    # (A contrastive run enables none: its validation is pairs.evaluator; a relation says so.)
    self.measurements = _Measurements(config, model, self.source, placement,
                                      self.eval_batch_size, ood_datasets)
    self.fewshot = None
    if fewshot_datasets:
      f = config.fewshot
      self.fewshot = FewshotEvaluator(None, fewshot_datasets, shots=f.shots, seeds=f.seeds,
                                      l2_regs=f.l2_regs, put=placement.put, prefix="fewshot",
                                      protocol=f.protocol)
      self.feature_step = jax.jit(make_feature_fn(model), compiler_options=options)
    d = config.data
    # On the devices one batch ahead, its copy overlapping the step (images as uint8 pixels:
    # runner/models/inputs.py); `position` counts the batches taken, not those put ahead.
    self.batches = placement.prefetch(data.train_batches(
        self.source, d.split, d.pp_train, self.batch_size // self.processes["process_count"],
        seed=self.seed, start=self.position, shuffle_buffer=d.shuffle_buffer, text=self.text,
        label_noise=d.label_noise, num_shards=d.num_shards, cache=d.cache, **self.processes))
    self.start_step = int(self.state.step)
    self.progress = Progress(self.steps, self.start_step, self.batch_size, desc=self.stage,
                             enabled=config.logger.progress)
    self.progress.message(
        f"[{self.stage}] {model.__class__.__name__} with "
        f"{count_params(self.abstract):,} parameters, {origin}; {self.steps} steps of "
        f"{self.batch_size} images on {placement.mesh.size} device(s) -> {config.workdir}")
    self.history = []
    self.last_train = self.writer.last_logged_training(self.start_step) if self.start_step else {}
    self.guard = _DivergenceGuard(self.checkpointer, config.optim, config.schedule.warmup_steps)

  def evaluator(self, split: str, prefix: str):
    """The loss and precision (or a contrastive run's measurements) of a split."""
    batches = data.eval_batches(self.source, split, self.config.data.pp,
                                self.eval_batch_size // self.processes["process_count"],
                                cache=self.config.data.cache, text=self.text, **self.processes)
    if self.pairs:
      return self.pairs.evaluator(batches, prefix, self.placement.put)
    return ClassificationEvaluator(self.eval_step, batches, prefix=prefix, put=self.placement.put)

  def fewshot_metrics(self, step: int) -> dict:
    """Few-shot accuracy of the current parameters: their features recomputed at every call."""
    metrics = self.fewshot.run([functools.partial(self.feature_step, self.state.params)])
    means = " ".join(f"{k.split('/')[2]} {v:.4f}" for k, v in metrics.items()
                     if k.startswith("fewshot/mean/") and k.endswith("/accuracy"))
    self.progress.message(f"[{self.stage}] step {step} few-shot mean accuracy: {means}")
    return metrics

  def train(self, step: int) -> None:
    """One step on the next batch; the divergence check trails it by one."""
    batch = next(self.batches)
    self.position += self.batch_size // self.processes["process_count"]
    self.state, metrics = self.step_fn(self.state, batch)
    self.guard.dispatched(step, metrics)
    self.history.append(metrics)
    self.progress.step_done(step)

  def log_evaluate_and_save(self, step: int) -> None:
    """What is due after `step`: log, evaluation, few-shot, checkpoint (always the last step's)."""
    t, last = self.config.train, step == self.steps
    if step % t.log_every_steps == 0 or last:
      self.guard.check_pending()
      fetched = jax.device_get(self.history)
      self.last_train = {k: np.mean([m[k] for m in fetched], axis=0) for k in fetched[0]}
      self.last_train["train/images_per_s"] = self.progress.images_per_second(step)
      self.history = []
      self.writer.write(step, self.last_train)
      self.progress.report(step, self.last_train)
    eval_every = self.config.eval.every_steps
    if eval_every and step % eval_every == 0 and not last:
      metrics = self.val.run(self.state.params)
      metrics.update(self.measurements.run(self.state.params).summary)
      self.writer.write(step, metrics)
      self.progress.report(step, {**self.last_train, **metrics})
    fewshot_every = self.config.fewshot.every_steps if self.fewshot else 0
    if fewshot_every and step % fewshot_every == 0 and not last:
      self.writer.write(step, self.fewshot_metrics(step))
    if self.checkpointer.should_save(step) or last:
      self.save(step)

  def save(self, step: int) -> None:
    self.guard.check_pending()  # never save a non-finite state
    self.checkpointer.save(step, self.state.params, self.state.opt_state, config=self.stored_config,
                           meta={"step": step, "position": self.position})

  def stop(self, step: int, signum: int) -> None:
    """A signal asked to stop after `step`: save, requeue a SLURM job, raise Interrupted."""
    self.save(step)
    self.checkpointer.wait()
    saved = (f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved in "
             f"{self.checkpointer.directory}")
    requeued = preemption.requeue() if jax.process_index() == 0 else None
    if requeued:  # SLURM starts the job again; it resumes from this checkpoint
      raise Interrupted(f"{saved}; SLURM job {requeued} requeued to resume from it.", signum)
    raise Interrupted(f"{saved}. Rerun the same command to resume.", signum)

  def final_evaluation(self) -> tuple[dict, dict]:
    """(the final validation, test and few-shot metrics; the evaluators' pictures)."""
    params = self.state.params
    final = self.val.run(params)
    measured = self.measurements.run(params, final=True)
    final.update(measured.summary)
    if self.config.data.test_split:
      final.update(self.evaluator(self.config.data.test_split, "test").run(params))
    if self.fewshot is not None:
      final.update(self.fewshot_metrics(self.steps))
    return final, measured.images

  def finish(self, final: dict, images: dict) -> dict:
    """Once the final checkpoint is committed: the final metrics logged, the summary written."""
    self.checkpointer.wait()  # the final checkpoint is committed before the run reports success
    self.writer.write(self.steps, final)
    for key, path in images.items():
      self.writer.log_image(self.steps, f"val/{key}", path)
    self.progress.report(self.steps, {**self.last_train, **final})
    summary = {"step": self.steps, **self.last_train, **final,
               "params/total": count_params(self.abstract)}
    self.writer.summary(summary)
    return summary

  def close(self) -> None:
    if self.progress is not None:
      self.progress.close()
    self.checkpointer.close()
    if self.writer is not None:
      self.writer.close()


def train_and_evaluate(config: TrainTask, *, start: Start, source, placement: Placement,
                       stage: str = "train", fewshot_datasets: dict | None = None,
                       ood_datasets: list | None = None, pairs=None) -> dict:
  """Trains `start`'s model (runner/train/start.py) on `source` as `config` says; returns the final
  metrics (also summary.json).

  `fewshot_datasets` (name -> (pool batches, test batches, num_classes)) adds linear few-shot
  accuracy of the current parameters every `fewshot.every_steps` and at the end, as `fewshot/...`.
  The evaluators `eval.*` enables that run in training (runner/evaluators, built-in or a plug-in's;
  OOD detection against `ood_datasets`) run on the validation split with the evaluation, under
  `val/`, their pictures and files written at the end. `pairs` (runner/training/contrastive.py
  `PairTraining`): a contrastive model of image-text pairs, its objective, tokens and evaluator."""
  environment.write_config(config, config.workdir)  # what later stages read, and what it ran on
  run = _Run(config, start=start, source=source, placement=placement, stage=stage, pairs=pairs)
  try:
    with placement.context():
      run.start(fewshot_datasets, ood_datasets or [])
      with _StopFlag() as stop:
        for step in range(run.start_step + 1, run.steps + 1):
          run.train(step)
          run.log_evaluate_and_save(step)
          if stop.signum is not None and step != run.steps:
            run.stop(step, stop.signum)
        run.guard.check_pending()
      final, images = run.final_evaluation()
    return run.finish(final, images)
  finally:
    run.close()
