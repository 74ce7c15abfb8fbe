"""E independent two-layer GELU MLPs, each applied to its own buffer, as one batched matmul."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn


def _stacked(init, num: int):
  """An initializer for E stacked copies of a per-expert parameter, each drawn independently."""
  def stacked_init(key, shape, dtype=jnp.float32):
    keys = jax.random.split(key, num)
    return jax.vmap(lambda k: init(k, shape[1:], dtype))(keys)
  return stacked_init


class MlpExperts(nn.Module):
  """Parameters mirror a dense `MlpBlock` (fc1, fc2) with a leading expert axis, so a dense
  checkpoint's MLP can initialise every expert."""
  num_experts: int
  mlp_dim: int
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    """x: (E, G, C, D) expert-major buffers -> (E, G, C, D)."""
    e_, g, c, d = x.shape
    e = self.num_experts
    xavier = nn.initializers.xavier_uniform()
    tiny = nn.initializers.normal(1e-6)
    part = nn.with_logical_partitioning
    w1 = self.param("fc1_kernel", part(_stacked(xavier, e), ("expert", "embed", "mlp")),
                    (e, d, self.mlp_dim))
    b1 = self.param("fc1_bias", part(_stacked(tiny, e), ("expert", "mlp")), (e, self.mlp_dim))
    w2 = self.param("fc2_kernel", part(_stacked(xavier, e), ("expert", "mlp", "embed")),
                    (e, self.mlp_dim, d))
    b2 = self.param("fc2_bias", part(_stacked(tiny, e), ("expert", "embed")), (e, d))
    x = x.reshape(e, g * c, d).astype(self.dtype)
    h = jnp.einsum("emd,edh->emh", x, w1.astype(self.dtype)) + b1[:, None, :].astype(self.dtype)
    h = nn.gelu(h)
    h = nn.Dropout(self.dropout_rate)(h, deterministic=not train)
    y = jnp.einsum("emh,ehd->emd", h, w2.astype(self.dtype)) + b2[:, None, :].astype(self.dtype)
    y = nn.Dropout(self.dropout_rate)(y, deterministic=not train)
    return y.reshape(e, g, c, d)
