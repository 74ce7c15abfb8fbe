"""The train state: step, parameters and optimizer state, one pytree."""
from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: dict
  opt_state: optax.OptState


def init_params(model: nn.Module, image_shape: tuple[int, ...], seed: int):
  """Parameters (unboxed) and their logical partition specs, from one small forward pass.

  The batch used for initialisation has one routing group of images; shapes do not depend on it.
  """
  rngs = {"params": jax.random.key(seed), "gating": jax.random.key(seed + 1),
          "dropout": jax.random.key(seed + 2)}
  images = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
  with nn.logical_axis_rules(()):  # placement is the caller's business (jit out_shardings)
    variables = model.init(rngs, images, train=False)
    return nn.meta.unbox(variables["params"]), nn.get_partition_spec(variables)["params"]


def fresh_params(model: nn.Module, image_shape: tuple[int, ...], seed: int, **jit_options):
  """`init_params`'s parameters computed by one compiled program, as every stage starts them
  (`jit_options`: e.g. out_shardings). Run eagerly, each operation of the init compiles on its
  own: seconds for a model the process has not initialised before."""
  return jax.jit(lambda: init_params(model, image_shape, seed)[0], **jit_options)()


def abstract_params(model: nn.Module, image_shape: tuple[int, ...]):
  """Shapes and logical specs of the parameters without allocating them."""
  def init():
    images = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
    return model.init({"params": jax.random.key(0), "gating": jax.random.key(0),
                       "dropout": jax.random.key(0)}, images, train=False)
  with nn.logical_axis_rules(()):
    boxed = jax.eval_shape(init)
    return nn.meta.unbox(boxed["params"]), nn.get_partition_spec(boxed)["params"]


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
