"""The training loop shared by `pretrain` and `finetune`.

Start-up precedence (big_vision's, made explicit): resume from this workdir's latest checkpoint >
initialise from an earlier stage's parameters > initialise from scratch. Durations are converted
to steps once, here. SIGINT/SIGTERM finish the current step, save a checkpoint, and exit; rerunning
the same command resumes.
"""
from __future__ import annotations

import functools
import math
import pathlib
import signal

import jax
import jax.numpy as jnp
import numpy as np

from runner import data
from runner.checkpoint import Checkpointer
from runner.errors import ConfigError, UserError
from runner.evaluators.classification import ClassificationEvaluator, make_eval_step
from runner.evaluators.fewshot import FewshotEvaluator, make_feature_fn
from runner.logging import MetricWriter, Progress
from runner.parallel import Placement, replicated
from runner.train import optimizers, schedules, state as state_lib
from runner.train.step import make_train_step


class Interrupted(UserError):
  """The run was stopped by a signal after saving a checkpoint."""


def total_steps(train: dict, num_examples: int, batch_size: int) -> int:
  """train.steps, or train.epochs converted with the split size and batch size."""
  if train.get("steps"):
    return int(train["steps"])
  if train.get("epochs"):
    return max(1, math.ceil(train["epochs"] * num_examples / batch_size))
  raise ConfigError("set the training duration: train.steps=<n> or train.epochs=<x>.")


class _StopFlag:
  """Turns the first SIGINT/SIGTERM into a request to stop after the current step."""

  def __init__(self):
    self.signum = None
    self.previous = {}

  def __enter__(self):
    for sig in (signal.SIGINT, signal.SIGTERM):
      try:
        self.previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: signals stay as they are
        pass
    return self

  def _handle(self, signum, frame):
    if self.signum is not None:  # second signal: stop now
      raise KeyboardInterrupt
    self.signum = signum

  def __exit__(self, *exc):
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)


def _mean_metrics(history: list[dict]) -> dict:
  fetched = jax.device_get(history)
  return {k: np.mean([m[k] for m in fetched], axis=0) for k in fetched[0]}


def _abstract(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      shardings)


def initial_state(checkpointer: Checkpointer, *, model, tx, image_shape, placement: Placement,
                  seed: int, init_params=None):
  """(state, state shardings, data position, where it came from): resume > init > scratch."""
  abstract, logical = state_lib.abstract_params(model, image_shape)
  param_shardings = placement.shardings(logical)
  opt_init = jax.jit(tx.init).lower(_abstract(abstract, param_shardings)).compile()
  shardings = state_lib.TrainState(step=replicated(placement.mesh), params=param_shardings,
                                   opt_state=opt_init.output_shardings)
  latest = checkpointer.latest_step()
  if latest is not None:
    params, opt_state, meta = checkpointer.restore(
        latest, _abstract(abstract, param_shardings),
        _abstract(jax.eval_shape(tx.init, abstract), shardings.opt_state))
    state = state_lib.TrainState(step=jnp.asarray(latest, jnp.int32), params=params,
                                 opt_state=opt_state)
    return state, shardings, int(meta["position"]), f"resumed from step {latest}"
  if init_params is not None:
    params = jax.device_put(init_params, param_shardings)
    origin = "initialised from an earlier stage"
  else:
    params = jax.jit(lambda: state_lib.init_params(model, image_shape, seed)[0],
                     out_shardings=param_shardings)()
    origin = "initialised from scratch"
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=opt_init(params))
  return state, shardings, 0, origin


def _fewshot_summary(metrics: dict) -> str:
  means = {k.split("/")[2]: v for k, v in metrics.items()
           if k.startswith("fewshot/mean/") and k.endswith("/accuracy")}
  return " ".join(f"{shots} {v:.4f}" for shots, v in means.items())


def train_and_evaluate(config: dict, *, model, source, placement: Placement, workdir: str,
                       init_params=None, stage: str = "train",
                       fewshot_datasets: dict | None = None) -> dict:
  """Trains `model` on `source` as `config` says; returns the final metrics (also summary.json).

  `fewshot_datasets` (name -> (pool batches, test batches, num_classes)) adds linear few-shot
  accuracy of the current parameters every `fewshot.every_steps` and at the end, as `fewshot/...`.
  """
  workdir = pathlib.Path(workdir)
  d, t, o, s = config["data"], config["train"], config["optim"], config["schedule"]
  seed = int(config["seed"])
  batch_size = int(d["batch_size"])
  eval_batch_size = int(config["eval"].get("batch_size") or d.get("eval_batch_size") or batch_size)
  steps = total_steps(t, source.num_examples(d["split"]), batch_size)
  processes = dict(process_index=jax.process_index(), process_count=jax.process_count())

  image_shape = data.image_shape(source, d["split"], d["pp_train"])
  schedule = schedules.make_schedule(s["name"], o["lr"], steps, s.get("warmup_steps", 0),
                                     s.get("end_lr_fraction", 0.0), s.get("timescale"),
                                     s.get("cooldown_steps", 0))
  abstract, _ = state_lib.abstract_params(model, image_shape)
  tx = optimizers.make_optimizer(schedule=schedule, params=abstract, **o)
  ckpt = config["checkpoint"]
  checkpointer = Checkpointer(workdir / "checkpoints", keep=ckpt["keep"],
                              every_steps=ckpt["every_steps"], async_save=ckpt.get("async_save", True))
  writer = MetricWriter(str(workdir), run_config=config, wandb=config["logger"]["wandb"],
                        job_type=stage)
  progress = None
  try:
    with placement.context():
      state, shardings, position, origin = initial_state(
          checkpointer, model=model, tx=tx, image_shape=image_shape, placement=placement,
          seed=seed, init_params=init_params)
      step_fn = jax.jit(
          make_train_step(model, tx, schedule, loss=t["loss"], aux_loss_weight=t["aux_loss_weight"],
                          accum_steps=t.get("accum_steps", 1), seed=seed),
          in_shardings=(shardings, placement.batch_sharding), out_shardings=(shardings, None),
          donate_argnums=0)
      eval_step = jax.jit(make_eval_step(model, t["loss"]))

      def evaluator(split, prefix):
        batches = data.eval_batches(source, split, d["pp"],
                                    eval_batch_size // processes["process_count"], **processes)
        return ClassificationEvaluator(eval_step, batches, prefix=prefix, put=placement.put)
      val = evaluator(d["eval_split"], "val")
      fewshot_cfg, fewshot = config.get("fewshot") or {}, None
      if fewshot_datasets:
        fewshot = FewshotEvaluator(None, fewshot_datasets, shots=fewshot_cfg["shots"],
                                   seeds=fewshot_cfg["seeds"], l2_regs=fewshot_cfg.get("l2_regs"),
                                   put=placement.put, prefix="fewshot")
        feature_step = jax.jit(make_feature_fn(model))
      fewshot_every = int(fewshot_cfg.get("every_steps") or 0) if fewshot else 0

      def run_fewshot(step):
        """Features of the current parameters: recomputed at every call."""
        metrics = fewshot.run([functools.partial(feature_step, state.params)])
        progress.message(f"[{stage}] step {step} few-shot mean accuracy: "
                         f"{_fewshot_summary(metrics)}")
        return metrics
      batches = data.train_batches(source, d["split"], d["pp_train"],
                                   batch_size // processes["process_count"], seed=seed,
                                   start=position, shuffle_buffer=d["shuffle_buffer"], **processes)

      start_step = int(state.step)
      progress = Progress(steps, start_step, batch_size, desc=stage,
                          enabled=config["logger"].get("progress", True))
      progress.message(f"[{stage}] {model.__class__.__name__} with "
                       f"{state_lib.count_params(abstract):,} parameters, {origin}; "
                       f"{steps} steps of {batch_size} images on {placement.mesh.size} device(s) "
                       f"-> {workdir}")
      log_every = max(1, int(t.get("log_every_steps", 50)))
      eval_every = int(config["eval"].get("every_steps") or 0)
      history, last_train = [], {}

      def save(step):
        checkpointer.save(step, state.params, state.opt_state,
                          meta={"step": step, "position": position}, config=config)

      with _StopFlag() as stop:
        for step in range(start_step + 1, steps + 1):
          batch = placement.put(next(batches))
          position += batch_size // processes["process_count"]
          state, metrics = step_fn(state, batch)
          history.append(metrics)
          progress.step_done(step)
          if step % log_every == 0 or step == steps:
            last_train = _mean_metrics(history)
            last_train["train/images_per_s"] = progress.images_per_second(step)
            history = []
            writer.write(step, last_train)
            progress.report(step, last_train)
          if eval_every and step % eval_every == 0 and step != steps:
            last_eval = val.run(state.params)
            writer.write(step, last_eval)
            progress.report(step, {**last_train, **last_eval})
          if fewshot_every and step % fewshot_every == 0 and step != steps:
            writer.write(step, run_fewshot(step))
          if checkpointer.should_save(step) or step == steps:
            save(step)
          if stop.signum is not None and step != steps:
            save(step)
            checkpointer.wait()
            raise Interrupted(f"stopped by signal {stop.signum} after step {step}; checkpoint "
                              f"saved in {workdir / 'checkpoints'}. Rerun the same command to "
                              "resume.")
      final = val.run(state.params)
      if d.get("test_split"):
        final.update(evaluator(d["test_split"], "test").run(state.params))
      if fewshot is not None:
        final.update(run_fewshot(steps))
    writer.write(steps, final)
    progress.report(steps, {**last_train, **final})
    summary = {"step": steps, **last_train, **final,
               "params/total": state_lib.count_params(abstract)}
    writer.summary(summary)
    return summary
  finally:
    if progress is not None:
      progress.close()
    checkpointer.close()
    writer.close()
