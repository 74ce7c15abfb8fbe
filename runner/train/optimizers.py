"""Optimizers through optax: Adam, SGD with momentum, Adafactor (and a plug-in's, registered by
name); per-parameter weight decay.

Each optimizer declares the `optim.*` keys it reads in its own `Config` dataclass, registered
with it (`register`), which adds them to the schema's `OptimConfig`; `OptimConfig` itself holds
what every optimizer reads (name, lr, weight_decay, grad_clip_norm)."""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from runner.config import components, registries
from runner.config.checks import Range, at_least, key, positive, rate


def param_names(params) -> dict:
  """The tree of "block_1/moe/experts/fc1_kernel"-style names, matched by weight-decay patterns."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), params)


# Never decayed: a heteroscedastic head's temperature logit (decay would pull τ to the middle of
# its bounds, which regularises nothing).
NO_DECAY = re.compile(r"(.*/)?pre_sigmoid_temperature")


def weight_decay_tree(params, weight_decay) -> dict:
  """Per-parameter decay: one float for all, or [[regex, value], ...] (first full match wins)."""
  given = [(".*", weight_decay)] if isinstance(weight_decay, (int, float)) else weight_decay
  rules = [(re.compile(pattern), float(value)) for pattern, value in given]

  def lookup(name):
    if NO_DECAY.fullmatch(name):
      return 0.0
    return next((value for pattern, value in rules if pattern.fullmatch(name)), 0.0)
  return jax.tree.map(lookup, param_names(params))


def decoupled_weight_decay(decay_tree) -> optax.GradientTransformation:
  """update += decay * param, applied before the learning rate (so the decay scales with it)."""
  def update(updates, state, params):
    # A frozen part (optax.multi_transform's MaskedNode) is left as it is.
    frozen = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    updates = jax.tree.map(lambda u, p, d: u if frozen(u) or not d else u + d * p,
                           updates, params, decay_tree, is_leaf=frozen)
    return updates, state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


ADAFACTOR_DECAY_RATE = 0.8  # the exponent of the second-moment decay 1 - t^-0.8


def adafactor_decay_rate_fn(beta2_cap: float):
  """The second-moment decay at (0-based) step i: min(beta2_cap, 1 - (i + 1)^-exponent), capping
  optax's schedule as big_vision's `scale_by_adafactor` (`beta2_cap`, default 0.999) and vmoe's
  `scale_by_big_vision_adafactor` (`decay_rate_max`, 0.999) do, so the second moment keeps
  averaging over ~1000 steps instead of tending to an all-time mean."""
  def decay_rate(step, exponent):
    t = jnp.asarray(step, jnp.float32) + 1.0
    return jnp.minimum(beta2_cap, 1.0 - t ** (-exponent))
  return decay_rate


def make_optimizer(name: str, schedule, params, *, weight_decay=0.0, frozen: str | None = None,
                   grad_clip_norm: float | None = None, **options) -> optax.GradientTransformation:
  """clip -> precondition (adam | sgd | adafactor | a plug-in's) -> decoupled weight decay -> lr.

  `options` are optim.* keys: the optimizer reads those its Config declares (their defaults where
  not given) and ignores the others. `frozen`: a regex of parameter names that never change
  (LiT's locked image tower): they get no update, no weight decay and no optimizer state."""
  optimizer = registries.OPTIMIZERS.get(name)
  learn = optax.chain(
      optax.clip_by_global_norm(grad_clip_norm) if grad_clip_norm else optax.identity(),
      optimizer.fn(**optimizer.values(options)),
      decoupled_weight_decay(weight_decay_tree(params, weight_decay)),
      optax.scale_by_learning_rate(schedule),
  )
  if not frozen:
    return learn
  pattern = re.compile(frozen)
  labels = jax.tree.map(lambda name: "frozen" if pattern.fullmatch(name) else "learn",
                        param_names(params))
  return optax.multi_transform({"learn": learn, "frozen": optax.set_to_zero()}, labels)


def register(name: str, Config: type | None = None, problem=None, reads: tuple[str, ...] = ()):
  """Registers `optim.name=<name>` (a decorator, for the built-ins and a plug-in's): a function
  taking the keys of `Config` as keyword arguments and returning the optax preconditioner, which
  every optimizer chains with clipping, weight decay and the learning rate (optim.grad_clip_norm,
  optim.weight_decay, optim.lr). `Config`, `problem`, `reads`: as docs/extending.md says."""
  def wrap(make):
    components.register(components.OPTIMIZER, name, make, Config, problem, reads)
    return make
  return wrap


@dataclasses.dataclass
class AdamConfig:
  """optim.* of optim.name=adam."""
  b1: float = key(0.9, rate())
  b2: float = key(0.999, rate())
  eps: float = key(1e-8, positive())


@register("adam", AdamConfig)
def _adam(*, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
  return optax.scale_by_adam(b1=b1, b2=b2, eps=eps)


@dataclasses.dataclass
class SgdConfig:
  """optim.* of optim.name=sgd."""
  momentum: float = key(0.9, rate())
  nesterov: bool = False


@register("sgd", SgdConfig)
def _sgd(*, momentum: float, nesterov: bool) -> optax.GradientTransformation:
  return optax.trace(decay=momentum, nesterov=nesterov) if momentum else optax.identity()


@dataclasses.dataclass
class AdafactorConfig:
  """optim.* of optim.name=adafactor: big_vision's variant (as vmoe trains V-MoE-15B with):
  factored second moments of parameters whose two largest dims are >= `min_dim_size_to_factor`,
  decay min(beta2_cap, 1 - t^-0.8), epsilon 1e-30; then update clipping by block RMS at
  `clipping_threshold` (None: none, as big_vision's and vmoe's defaults; the Adafactor paper's
  d = 1 is this project's default); then momentum `b1` (an EMA without debiasing; 0: none)."""
  b1: float = key(0.9, rate())  # adam's too: the same type and default
  beta2_cap: float = key(0.999, Range(0, 1, low_open=True), "Adafactor: the second-moment decay "
                         "min(beta2_cap, 1 - t^-0.8), as big_vision and vmoe; 1: uncapped")
  min_dim_size_to_factor: int = key(32, at_least(1), "Adafactor: factor the second moment of a "
                                    "parameter whose two largest dims are at least this (vmoe: "
                                    "num_experts + 1 keeps the expert axis unfactored)")
  clipping_threshold: Optional[float] = key(1.0, positive(), "Adafactor: update clipping by block "
                                            "RMS; null: none, as big_vision and vmoe")


@register("adafactor", AdafactorConfig)
def _adafactor(*, b1: float, beta2_cap: float, min_dim_size_to_factor: int,
               clipping_threshold: float | None) -> optax.GradientTransformation:
  return optax.chain(
      optax.scale_by_factored_rms(factored=True, decay_rate=ADAFACTOR_DECAY_RATE,
                                  step_offset=0, min_dim_size_to_factor=min_dim_size_to_factor,
                                  epsilon=1e-30, decay_rate_fn=adafactor_decay_rate_fn(beta2_cap)),
      optax.clip_by_block_rms(clipping_threshold) if clipping_threshold else optax.identity(),
      optax.ema(b1, debias=False) if b1 else optax.identity())
