"""The training loop shared by `pretrain` and `finetune`.

Start-up precedence (big_vision's, made explicit): resume from this workdir's latest checkpoint >
initialise from an earlier stage's parameters > initialise from scratch. Durations are converted
to steps once, here. SIGINT/SIGTERM finish the current step, save a checkpoint, and exit; rerunning
the same command resumes.
"""
from __future__ import annotations

import math
import pathlib
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np

from runner import data, parallel
from runner.checkpoint import Checkpointer
from runner.errors import ConfigError, UserError
from runner.evaluators.classification import ClassificationEvaluator, make_eval_step
from runner.logging import MetricWriter, Progress
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


def train_and_evaluate(config: dict, *, model, source, workdir: str, init_params=None,
                       stage: str = "train") -> dict:
  """Trains `model` on `source` as `config` says; returns the final metrics (also summary.json)."""
  workdir = pathlib.Path(workdir)
  d, t, o, s = config["data"], config["train"], config["optim"], config["schedule"]
  seed = int(config["seed"])
  batch_size = int(d["batch_size"])
  eval_batch_size = int(config["eval"].get("batch_size") or d.get("eval_batch_size") or batch_size)
  steps = total_steps(t, source.num_examples(d["split"]), batch_size)

  mesh = parallel.make_mesh()
  rules = parallel.mesh.DP_RULES
  batch_sharding = parallel.batch_sharding(mesh)
  process_count, process_index = jax.process_count(), jax.process_index()
  put = lambda batch: jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(batch_sharding, x), batch)

  image_shape = data.image_shape(source, d["split"], d["pp_train"])
  abstract, logical = state_lib.abstract_params(model, image_shape)
  param_shardings = parallel.shardings_from_logical(logical, mesh, rules)
  schedule = schedules.make_schedule(s["name"], o["lr"], steps, s.get("warmup_steps", 0),
                                     s.get("end_lr_fraction", 0.0), s.get("timescale"),
                                     s.get("cooldown_steps", 0))
  tx = optimizers.make_optimizer(schedule=schedule, params=abstract, **o)
  opt_init = jax.jit(tx.init).lower(jax.tree.map(
      lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract,
      param_shardings)).compile()
  opt_shardings = opt_init.output_shardings

  ckpt_cfg = config["checkpoint"]
  checkpointer = Checkpointer(workdir / "checkpoints", keep=ckpt_cfg["keep"],
                              every_steps=ckpt_cfg["every_steps"],
                              async_save=ckpt_cfg.get("async_save", True))
  writer = MetricWriter(str(workdir), run_config=config, wandb=config["logger"]["wandb"],
                        job_type=stage)
  latest = checkpointer.latest_step()
  position = 0
  with parallel.with_rules(mesh, rules):
    if latest is not None:
      with_sharding = lambda tree, shardings: jax.tree.map(
          lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, shardings)
      params, opt_state, meta = checkpointer.restore(
          latest, with_sharding(abstract, param_shardings),
          with_sharding(jax.eval_shape(tx.init, abstract), opt_shardings))
      position = int(meta["position"])
      origin = f"resumed from step {latest}"
    else:
      if init_params is not None:
        params = jax.device_put(init_params, param_shardings)
        origin = "initialised from an earlier stage"
      else:
        params = jax.jit(lambda: state_lib.init_params(model, image_shape, seed)[0],
                         out_shardings=param_shardings)()
        origin = "initialised from scratch"
      opt_state = opt_init(params)
    state = state_lib.TrainState(step=jnp.asarray(latest or 0, jnp.int32), params=params,
                                 opt_state=opt_state)
    state_shardings = state_lib.TrainState(step=parallel.replicated(mesh),
                                           params=param_shardings, opt_state=opt_shardings)
    step_fn = jax.jit(
        make_train_step(model, tx, schedule, loss=t["loss"], aux_loss_weight=t["aux_loss_weight"],
                        accum_steps=t.get("accum_steps", 1), seed=seed),
        in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, None),
        donate_argnums=0)
    eval_step = jax.jit(make_eval_step(model, t["loss"]))

    def evaluator(split, prefix):
      batches = data.eval_batches(source, split, d["pp"], eval_batch_size // process_count,
                                  process_index=process_index, process_count=process_count)
      return ClassificationEvaluator(eval_step, batches, prefix=prefix, put=put)
    val = evaluator(d["eval_split"], "val")
    batches = data.train_batches(source, d["split"], d["pp_train"], batch_size // process_count,
                                 seed=seed, start=position, shuffle_buffer=d["shuffle_buffer"],
                                 process_index=process_index, process_count=process_count)

    start_step = int(latest or 0)
    progress = Progress(steps, start_step, batch_size, desc=stage,
                        enabled=config["logger"].get("progress", True))
    progress.message(f"[{stage}] {model.__class__.__name__} with "
                     f"{state_lib.count_params(abstract):,} parameters, {origin}; "
                     f"{steps} steps of {batch_size} images -> {workdir}")
    log_every = max(1, int(t.get("log_every_steps", 50)))
    eval_every = int(config["eval"].get("every_steps") or 0)
    history, last_train, last_eval = [], {}, {}

    def save(step):
      checkpointer.save(step, state.params, state.opt_state,
                        meta={"step": step, "position": position}, config=config)

    try:
      with _StopFlag() as stop:
        for step in range(start_step + 1, steps + 1):
          batch = put(next(batches))
          position += batch_size // process_count
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
      writer.write(steps, final)
      progress.report(steps, {**last_train, **final})
      summary = {"step": steps, **{k: v for k, v in last_train.items()}, **final,
                 "params/total": state_lib.count_params(abstract)}
      writer.summary(summary)
      return summary
    finally:
      progress.close()
      checkpointer.close()
      writer.close()
