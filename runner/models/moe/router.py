"""The noisy TOP-k router of V-MoE as a Flax module: gates, dispatch plan and routing metrics."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from runner.models.moe import routing


class NoisyTopKRouter(nn.Module):
  """g(x) = TOP_k(softmax(Wx + eps)); returns a `DispatchPlan` and per-layer metrics.

  The router always computes in float32: routing decisions are discrete and bfloat16 rounding of
  the gates would change them.
  """
  num_experts: int
  k: int = 2
  capacity_ratio: float = 1.05
  eval_capacity_ratio: float | None = None
  batch_priority: bool = False
  priority: str = "max"
  noise_std: float = 1.0

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> tuple[routing.DispatchPlan, dict]:
    """x: (G, S, D) groups of tokens."""
    _, num_tokens, _ = x.shape
    # The expert dimension of the router stays whole on every device: top-k needs all of it.
    kernel_init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", None))
    logits = nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32,
                      param_dtype=jnp.float32, kernel_init=kernel_init,
                      name="dense")(x.astype(jnp.float32))
    gates_clean = jax.nn.softmax(logits)
    metrics = {"importance_loss": routing.importance_loss(gates_clean).mean()}
    noise_std = self.noise_std / self.num_experts
    if train and noise_std > 0:
      noisy = logits + noise_std * jax.random.normal(self.make_rng("gating"), logits.shape)
      gates = jax.nn.softmax(noisy)
      metrics["load_loss"] = routing.load_loss(logits, noisy, noise_std, self.k).mean()
      metrics["auxiliary_loss"] = 0.5 * metrics["importance_loss"] + 0.5 * metrics["load_loss"]
    else:
      gates = gates_clean
      metrics["auxiliary_loss"] = metrics["importance_loss"]
    ratio = self.capacity_ratio
    if not train and self.eval_capacity_ratio is not None:
      ratio = self.eval_capacity_ratio
    capacity = routing.expert_capacity(num_tokens, self.num_experts, self.k, ratio)
    plan = routing.plan_dispatch(gates, k=self.k, capacity=capacity,
                                 batch_priority=self.batch_priority, priority=self.priority)
    kept = plan.kept
    metrics["fraction_dropped_tokens"] = jnp.mean(~kept.any(axis=-1))
    metrics["fraction_dropped_assignments"] = jnp.mean(~kept)
    # Fraction of the layer's buffer slots each expert filled, averaged over groups.
    metrics["expert_load"] = jnp.mean(plan.expert_of_slot_filled, axis=0) / capacity
    return plan, metrics
