"""Optimizers through optax: Adam, SGD with momentum, Adafactor; per-parameter weight decay."""
from __future__ import annotations

import re

import jax
import optax

OPTIMIZERS = ("adam", "sgd", "adafactor")


def param_names(params) -> dict:
  """The tree of "block_1/moe/experts/fc1_kernel"-style names, matched by weight-decay patterns."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), params)


# Never decayed: a heteroscedastic head's temperature logit (decay would pull τ to the middle of
# its bounds, which regularises nothing).
NO_DECAY = re.compile(r"(.*/)?pre_sigmoid_temperature")


def weight_decay_tree(params, weight_decay) -> dict:
  """Per-parameter decay: one float for all, or [[regex, value], ...] (first full match wins)."""
  if isinstance(weight_decay, (int, float)):
    rules = [(re.compile(".*"), float(weight_decay))]
  else:
    rules = [(re.compile(pattern), float(value)) for pattern, value in weight_decay]

  def lookup(name):
    if NO_DECAY.fullmatch(name):
      return 0.0
    for pattern, value in rules:
      if pattern.fullmatch(name):
        return value
    return 0.0
  return jax.tree.map(lookup, param_names(params))


def decoupled_weight_decay(decay_tree) -> optax.GradientTransformation:
  """update += decay * param, applied before the learning rate (so the decay scales with it)."""
  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params):
    updates = jax.tree.map(lambda u, p, d: u + d * p if d else u, updates, params, decay_tree)
    return updates, state
  return optax.GradientTransformation(init, update)


def make_optimizer(name: str, schedule, params, *, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, momentum: float = 0.9, nesterov: bool = False,
                   weight_decay=0.0, grad_clip_norm: float | None = None,
                   **unused) -> optax.GradientTransformation:
  """clip -> precondition (adam | momentum | adafactor) -> decoupled weight decay -> learning rate."""
  del unused  # config keys of other optimizers (lr is in the schedule)
  if name == "adam":
    precondition = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
  elif name == "sgd":
    precondition = optax.trace(decay=momentum, nesterov=nesterov) if momentum else optax.identity()
  elif name == "adafactor":
    precondition = optax.chain(optax.scale_by_factored_rms(decay_rate=0.8),
                               optax.clip_by_block_rms(1.0),
                               optax.ema(b1, debias=False) if b1 else optax.identity())
  else:
    raise ValueError(f"unknown optimizer {name!r}; valid: {OPTIMIZERS}")
  return optax.chain(
      optax.clip_by_global_norm(grad_clip_norm) if grad_clip_norm else optax.identity(),
      precondition,
      decoupled_weight_decay(weight_decay_tree(params, weight_decay)),
      optax.scale_by_learning_rate(schedule),
  )
