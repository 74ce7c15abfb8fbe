"""The pure steps: train, (state, batch) -> (state, metrics), with optional gradient accumulation;
eval, (params, batch) -> sums over the batch's real examples.

Both are the compute a device runs, so they live below the evaluators and the data pipeline: this
module imports neither TensorFlow, Hydra nor OmegaConf (benchmarks/gpu.py runs them on a CUDA JAX
image that has none of them; the `compute-path` contract in pyproject.toml keeps it so)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from runner.config.preprocessing import DEVICE_VALUE_RANGE
from runner.losses.classification import LOSSES, precision_at_1, softmax_xent
from runner.models import inputs
from runner.models.heads import NOISE_RNG
from runner.models.param_updates import ParamUpdate, apply_param_updates, sown_collections
from runner.train import objectives
from runner.train.state import TrainState


def make_train_step(model, tx: optax.GradientTransformation, schedule, *, loss: str,
                    aux_loss_weight: float, accum_steps: int = 1, seed: int = 0,
                    objective=None, param_updates: tuple[ParamUpdate, ...] = ()):
  """Returns step(state, batch). Randomness (router noise, dropout, heteroscedastic draws) is a
  function of (seed, step), so a resumed run draws exactly what an uninterrupted one would.

  `objective(params, batch, rngs, collections) -> (loss, metrics)` (runner/train/objectives.py):
  by default the classification of `loss` (a partitioned batch ensemble trains on the mean of its
  members' cross-entropies, E³ App. D.1, not on the cross-entropy of their mean prediction).

  `param_updates` (runner/models/param_updates.py; a model's: runner.models.param_updates_of,
  e.g. loss-free balancing's bias): after the optimizer's update, each parameter they name is set
  only by its rule, from its value before the step and what the model sowed in training (returned
  by the objective; summed over micro-batches with gradient accumulation). Empty: the usual step."""
  objective = objective or objectives.classification(model, loss=loss,
                                                     aux_loss_weight=aux_loss_weight)
  root = jax.random.key(seed)
  collections = sown_collections(param_updates)

  def with_rngs(params, batch, rng):
    gating, dropout = jax.random.split(rng)
    # A heteroscedastic head's MC draws, a stream of its own: fold_in(rng, 1) would be the dropout
    # key (split(k)[i] == fold_in(k, i) with partitionable threefry).
    noise = jax.random.fold_in(rng, 2)
    return objective(params, batch, {"gating": gating, "dropout": dropout, NOISE_RNG: noise},
                     collections=collections)

  grad_fn = jax.value_and_grad(with_rngs, has_aux=True)

  def step(state: TrainState, batch: dict):
    rng = jax.random.fold_in(root, state.step)
    # The host's bookkeeping (`_mask`, ...) stays out; uint8 images keep their value range.
    batch = {k: v for k, v in batch.items() if not k.startswith("_") or k == DEVICE_VALUE_RANGE}
    if accum_steps == 1:
      (_, metrics), grads = grad_fn(state.params, batch, rng)
      sown = {c: metrics.pop(c, None) for c in collections}
    else:
      # Micro-batch i takes examples i, i + accum, ...: each is spread over all devices.
      def split(x):
        x = x.reshape((x.shape[0] // accum_steps, accum_steps) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)
      micro = jax.tree.map(split, batch)

      def body(acc, xs):
        i, part = xs
        (_, m), g = grad_fn(state.params, part, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, acc, g), m
      zeros = jax.tree.map(jnp.zeros_like, state.params)
      grads, per_micro = jax.lax.scan(body, zeros, (jnp.arange(accum_steps), micro))
      grads = jax.tree.map(lambda g: g / accum_steps, grads)
      sown = {c: jax.tree.map(lambda v: v.sum(axis=0), per_micro.pop(c, None)) for c in collections}
      metrics = jax.tree.map(lambda m: m.mean(axis=0), per_micro)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    params = apply_param_updates(param_updates, state.params, params, sown)
    metrics["train/grad_norm"] = optax.global_norm(grads)
    metrics["train/lr"] = schedule(state.step)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics
  return step


def make_eval_step(model, loss_name: str = "softmax_xent"):
  """(params, batch) -> sums over the real (unpadded) examples of the batch."""
  loss_fn = LOSSES[loss_name]

  def step(params, batch):
    logits, extras = model.apply({"params": params}, inputs.images(batch), train=False)
    mask = batch["_mask"].astype(jnp.float32)
    labels = batch["labels"]
    # NLL of the model's own likelihood: softmax's categorical, sigmoid's Bernoulli per class.
    nll = softmax_xent(logits, labels) if loss_name == "softmax_xent" else loss_fn(logits, labels)
    sums = {"prec@1": precision_at_1(logits, labels), "nll": nll, "loss": loss_fn(logits, labels)}
    out = {k: jnp.sum(v * mask) for k, v in sums.items()}
    out["count"] = jnp.sum(mask)
    for layer, metrics in extras["routing"].items():
      out[f"moe/{layer}/fraction_dropped_tokens"] = metrics["fraction_dropped_tokens"] * mask.sum()
    return out
  return step
