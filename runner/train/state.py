"""The train state: step, parameters and optimizer state, one pytree."""
from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: dict
  opt_state: optax.OptState


def init_variables(model: nn.Module, image_shape: tuple[int, ...], seed: int) -> dict:
  """The seed's boxed variables, from one small forward pass on one routing group of images (shapes
  do not depend on it); traced by the functions below (eagerly, each operation compiles alone)."""
  rngs = {"params": jax.random.key(seed), "gating": jax.random.key(seed + 1),
          "dropout": jax.random.key(seed + 2)}
  images = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
  with nn.logical_axis_rules(()):  # placement is the caller's business (jit out_shardings)
    return model.init(rngs, images, train=False)


# The last models' inits, each one jitted function of the seed: a run asks for a model's shapes,
# specs and values several times (Flax traces a model's init in a tenth of a second or more).
_INITS: list[tuple[nn.Module, tuple[int, ...], object]] = []
_KEPT_INITS = 4


def _traced_init(model: nn.Module, image_shape: tuple[int, ...]):
  """`init_variables` of this model object and shape as a jitted function of a uint32 seed, traced
  once however often it is asked for (identity, not equality: a Flax module cannot be hashed)."""
  image_shape = tuple(image_shape)
  for kept, shape, init in _INITS:
    if kept is model and shape == image_shape:
      return init
  init = jax.jit(lambda seed: init_variables(model, image_shape, seed))
  _INITS.append((model, image_shape, init))
  del _INITS[:-_KEPT_INITS]
  return init


def _seed(seed: int) -> np.uint32:
  """The seed as the traced init takes it: `jax.random.key` of any Python int equals the key of
  this uint32 (checked in tests/unit/test_fresh_params.py), seed + 1 and + 2 wrapping alike."""
  return np.uint32(seed % 2**32)


def fresh_params(model: nn.Module, image_shape: tuple[int, ...], seed: int, **jit_options):
  """The parameters (unboxed) of the seed's init, as every stage starts them, from one compiled
  program (eagerly, a new model's init takes seconds). `jit_options`: e.g. out_shardings."""
  init = _traced_init(model, image_shape)
  return jax.jit(lambda s: nn.meta.unbox(init(s)["params"]), **jit_options)(_seed(seed))


def _params_and_specs(variables: dict):
  """Unboxed parameters and their logical specs. Unboxing applies the active logical rules as
  sharding constraints; a caller's rules (under its mesh) do not apply here."""
  with nn.logical_axis_rules(()):
    return nn.meta.unbox(variables["params"]), nn.get_partition_spec(variables)["params"]


def init_params(model: nn.Module, image_shape: tuple[int, ...], seed: int):
  """`fresh_params`'s parameters and their logical partition specs, from one compiled init (the
  boxed variables keep their axis names through jit)."""
  return _params_and_specs(_traced_init(model, image_shape)(_seed(seed)))


def abstract_params(model: nn.Module, image_shape: tuple[int, ...]):
  """Shapes and logical specs of the parameters without allocating them."""
  return _params_and_specs(jax.eval_shape(_traced_init(model, image_shape), _seed(0)))


