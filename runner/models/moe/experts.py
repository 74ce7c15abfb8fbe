"""E independent two-layer GELU MLPs, each applied to its own buffer, as one batched matmul (the
GELU is the model's `activation`, runner/models/activations.py).

The module only owns the parameters; `apply_experts` is pure so that the MoE layer can run it in
`shard_map` on each device's experts; `apply_experts_ragged` on rows sorted by expert (dropless)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from runner.models.activations import DEFAULT, activate
from runner.models.moe.grouped_matmul import grouped_matmul, take_by_id

# Logical axes of the four expert parameters, in the order MlpExperts returns them.
LOGICAL_AXES = (("expert", "embed", "mlp"), ("expert", "mlp"), ("expert", "mlp", "embed"),
                ("expert", "embed"))
# Shared experts (DeepSeekMoE) process every token on every device: leading axis replicated.
SHARED_AXES = tuple((None,) + axes[1:] for axes in LOGICAL_AXES)


def _stacked(init, num: int):
  """An initializer for E stacked copies of a per-expert parameter, each drawn independently."""
  def stacked_init(key, shape, dtype=jnp.float32):
    keys = jax.random.split(key, num)
    return jax.vmap(lambda k: init(k, shape[1:], dtype))(keys)
  return stacked_init


class MlpExperts(nn.Module):
  """The (fc1_kernel, fc1_bias, fc2_kernel, fc2_bias) of E experts, each shaped like a dense
  `MlpBlock`'s with a leading expert axis, so a dense checkpoint's MLP can initialise them."""
  num_experts: int
  mlp_dim: int
  logical_axes: tuple = LOGICAL_AXES  # SHARED_AXES for shared experts

  @nn.compact
  def __call__(self, dim: int) -> tuple[jax.Array, ...]:
    e = self.num_experts
    xavier, tiny = nn.initializers.xavier_uniform(), nn.initializers.normal(1e-6)
    part = nn.with_logical_partitioning
    shapes = ((e, dim, self.mlp_dim), (e, self.mlp_dim), (e, self.mlp_dim, dim), (e, dim))
    names = ("fc1_kernel", "fc1_bias", "fc2_kernel", "fc2_bias")
    inits = (xavier, tiny, xavier, tiny)
    return tuple(self.param(n, part(_stacked(i, e), axes), s)
                 for n, i, axes, s in zip(names, inits, self.logical_axes, shapes))


def apply_experts(weights, x: jax.Array, *, dropout_rate: float = 0.0, rng=None,
                  dtype=jnp.float32, activation: str = DEFAULT) -> jax.Array:
  """x: (E, G, C, D) expert-major buffers -> (E, G, C, D); expert e uses weights[...][e]."""
  w1, b1, w2, b2 = (w.astype(dtype) for w in weights)
  e, g, c, d = x.shape
  x = x.reshape(e, g * c, d).astype(dtype)
  h = activate(jnp.einsum("emd,edh->emh", x, w1) + b1[:, None, :], activation)
  if dropout_rate and rng is not None:
    rng, sub = jax.random.split(rng)
    h = jnp.where(jax.random.bernoulli(sub, 1 - dropout_rate, h.shape), h / (1 - dropout_rate), 0)
  y = jnp.einsum("emh,ehd->emd", h, w2) + b2[:, None, :]
  if dropout_rate and rng is not None:
    y = jnp.where(jax.random.bernoulli(rng, 1 - dropout_rate, y.shape), y / (1 - dropout_rate), 0)
  return y.reshape(e, g, c, d)


def apply_experts_ragged(weights, rows: jax.Array, experts: jax.Array, group_sizes: jax.Array, *,
                         dropout_rate: float = 0.0, rng=None, dtype=jnp.float32,
                         method: str = "auto", activation: str = DEFAULT) -> jax.Array:
  """rows: (M, D) sorted by expert, group_sizes[e] of them expert e's, experts[r] the expert of
  row r -> (M, D), row r through its expert's MLP: one grouped matmul per layer (`method`:
  grouped_matmul.py's), the biases taken per row (`take_by_id`), expert dropout's masks drawn
  per row."""
  w1, b1, w2, b2 = (w.astype(dtype) for w in weights)
  x = rows.astype(dtype)
  h = activate(grouped_matmul(x, w1, group_sizes, method) + take_by_id(b1, experts), activation)
  if dropout_rate and rng is not None:
    rng, sub = jax.random.split(rng)
    h = jnp.where(jax.random.bernoulli(sub, 1 - dropout_rate, h.shape), h / (1 - dropout_rate), 0)
  y = grouped_matmul(h, w2, group_sizes, method) + take_by_id(b2, experts)
  if dropout_rate and rng is not None:
    y = jnp.where(jax.random.bernoulli(rng, 1 - dropout_rate, y.shape), y / (1 - dropout_rate), 0)
  return y
