"""Optimizers through optax: Adam, SGD with momentum, Adafactor (and a plug-in's, registered by
name); per-parameter weight decay."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax

from runner.config import registries


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
    # A frozen part (optax.multi_transform's MaskedNode) is left as it is.
    frozen = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    updates = jax.tree.map(lambda u, p, d: u if frozen(u) or not d else u + d * p,
                           updates, params, decay_tree, is_leaf=frozen)
    return updates, state
  return optax.GradientTransformation(init, update)


ADAFACTOR_DECAY_RATE = 0.8  # the exponent of the second-moment decay 1 - t^-0.8


def adafactor_decay_rate_fn(beta2_cap: float):
  """The second-moment decay at (0-based) step i: min(beta2_cap, 1 - (i + 1)^-exponent).

  big_vision's `scale_by_adafactor` (`beta2_cap`, default 0.999) and vmoe's
  `scale_by_big_vision_adafactor` (`decay_rate_max`, 0.999) cap optax's uncapped schedule, so
  the second moment keeps averaging over ~1000 steps instead of tending to an all-time mean.
  """
  def decay_rate(step, exponent):
    t = jnp.asarray(step, jnp.float32) + 1.0
    return jnp.minimum(beta2_cap, 1.0 - t ** (-exponent))
  return decay_rate


def make_optimizer(name: str, schedule, params, *, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, momentum: float = 0.9, nesterov: bool = False,
                   weight_decay=0.0, grad_clip_norm: float | None = None,
                   beta2_cap: float = 0.999, min_dim_size_to_factor: int = 32,
                   clipping_threshold: float | None = 1.0, frozen: str | None = None,
                   **unused) -> optax.GradientTransformation:
  """clip -> precondition (adam | momentum | adafactor) -> decoupled weight decay -> learning rate.

  Adafactor is big_vision's variant (as vmoe trains V-MoE-15B with): factored second moments of
  parameters whose two largest dimensions are >= `min_dim_size_to_factor`, decay
  min(beta2_cap, 1 - t^-0.8), epsilon 1e-30; then update clipping by block RMS at
  `clipping_threshold` (None: none, as big_vision's and vmoe's defaults; the Adafactor paper's
  d = 1 is this project's default); then momentum `b1` (an EMA without debiasing; 0: none).
  `frozen`: a regex of parameter names that never change (LiT's locked image tower): they get
  no update, no weight decay and no optimizer state.
  """
  precondition = registries.OPTIMIZERS.get(name)(
      b1=b1, b2=b2, eps=eps, momentum=momentum, nesterov=nesterov, beta2_cap=beta2_cap,
      min_dim_size_to_factor=min_dim_size_to_factor, clipping_threshold=clipping_threshold,
      **unused)
  learn = optax.chain(
      optax.clip_by_global_norm(grad_clip_norm) if grad_clip_norm else optax.identity(),
      precondition,
      decoupled_weight_decay(weight_decay_tree(params, weight_decay)),
      optax.scale_by_learning_rate(schedule),
  )
  if not frozen:
    return learn
  pattern = re.compile(frozen)
  labels = jax.tree.map(lambda name: "frozen" if pattern.fullmatch(name) else "learn",
                        param_names(params))
  return optax.multi_transform({"learn": learn, "frozen": optax.set_to_zero()}, labels)


def register(name: str):
  """Registers `optim.name=<name>` (a decorator, for the built-ins and a plug-in's): a function
  taking the optim.* keys as keyword arguments (b1, b2, eps, momentum, ...; lr excepted, which
  the schedule carries) and returning the optax preconditioner. Gradient clipping, weight decay
  and the learning rate are chained around it for every optimizer."""
  def wrap(make):
    registries.OPTIMIZERS.add(name, make)
    return make
  return wrap


@register("adam")
def _adam(*, b1: float, b2: float, eps: float, **_) -> optax.GradientTransformation:
  return optax.scale_by_adam(b1=b1, b2=b2, eps=eps)


@register("sgd")
def _sgd(*, momentum: float, nesterov: bool, **_) -> optax.GradientTransformation:
  return optax.trace(decay=momentum, nesterov=nesterov) if momentum else optax.identity()


@register("adafactor")
def _adafactor(*, b1: float, beta2_cap: float, min_dim_size_to_factor: int,
               clipping_threshold: float | None, **_) -> optax.GradientTransformation:
  return optax.chain(
      optax.scale_by_factored_rms(factored=True, decay_rate=ADAFACTOR_DECAY_RATE,
                                  step_offset=0, min_dim_size_to_factor=min_dim_size_to_factor,
                                  epsilon=1e-30, decay_rate_fn=adafactor_decay_rate_fn(beta2_cap)),
      optax.clip_by_block_rms(clipping_threshold) if clipping_threshold else optax.identity(),
      optax.ema(b1, debias=False) if b1 else optax.identity())
