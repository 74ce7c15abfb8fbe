"""ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): L_z = (1/B) sum_i (log sum_j exp x_ij)^2 over
the B tokens i and the logits x_ij of the experts j their router chooses among. It keeps the
logits small (large ones round the gates' exponentials badly), weighted by its own
model.router.z_loss_weight (the paper's c_z = 0.001), apart from train.aux_loss_weight."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def z_loss(logits: jax.Array) -> jax.Array:
  """L_z of router logits (..., E): the mean over every token of its squared log-sum-exp."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))
