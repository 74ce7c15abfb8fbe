"""How evenly token-choice routing spreads a batch over the experts: the auxiliary losses per
routing group or per batch, the diagnostics every step logs, and auxiliary-loss-free balancing by
a per-expert bias (docs/routers.md states each).

The sums run over the batch's group axis, which jit shards: under data or expert parallelism,
global reductions with no collective written here. With P partitions (a partitioned batch
ensemble) group g routes among partition g % P's experts, and sums run over one partition's
groups. The bias is a parameter only to be checkpointed, loaded, exported; no gradient moves it."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from runner.models.moe import routing
from runner.models.moe.dispatch import DispatchPlan, count_ids
from runner.models.param_updates import ParamUpdate

SCOPES = ("group", "batch")


def expert_sums(values: jax.Array, scope: str, partitions: int = 1) -> jax.Array:
  """(G, S, E) per-token values -> per-expert sums: (G, E) per group, or (P, E) per batch."""
  if scope not in SCOPES:
    raise ValueError(f"unknown balance scope {scope!r}; valid: {SCOPES}")
  sums = values.sum(axis=-2)
  if scope == "group":
    return sums
  return sums.reshape(-1, partitions, sums.shape[-1]).sum(axis=0)


def importance_loss(gates: jax.Array, scope: str = "group", partitions: int = 1) -> jax.Array:
  """V-MoE's importance loss (App. A.2, eqs. 1-2) at `scope`, averaged over groups (partitions)."""
  if scope == "group":  # as it always was, bit for bit
    return routing.importance_loss(gates).mean()
  return routing.squared_cv(expert_sums(gates, scope, partitions)).mean()


def load_loss(logits_clean: jax.Array, logits_noisy: jax.Array, noise_std: float, k: int,
              scope: str = "group", partitions: int = 1) -> jax.Array:
  """V-MoE's load loss (App. A.2, eqs. 3-6) at `scope`: the expected loads summed per group or
  per batch before the squared CV."""
  if scope == "group":
    return routing.load_loss(logits_clean, logits_noisy, noise_std, k).mean()
  p = routing.entry_probability(logits_clean, logits_noisy, noise_std, k)
  return routing.squared_cv(expert_sums(p, scope, partitions)).mean()


def assignment_counts(plan: DispatchPlan, partitions: int = 1) -> jax.Array:
  """(E,) int: load_i, the (token, choice) assignments of the batch whose TOP-k chose expert i,
  before capacity drops; with partitions, over the layer's P * E/P experts (p * E/P + e)."""
  groups, experts = plan.experts.shape[0], plan.num_experts
  chosen = count_ids(plan.experts.reshape(groups, -1).astype(jnp.int32), experts)  # (G, E/P)
  return chosen.reshape(groups // partitions, partitions * experts).sum(axis=0)


def diagnostics(plan: DispatchPlan, partitions: int = 1) -> dict[str, jax.Array]:
  """max_violation, dead_experts and saturated_experts of a plan (docs/routers.md);
  with partitions, over the layer's P * E/P experts."""
  groups = plan.experts.shape[0]
  load = assignment_counts(plan, partitions)  # (E,)
  mean = jnp.mean(load.astype(jnp.float32))
  full = plan.expert_of_slot_filled >= plan.capacity  # (G, E/P)
  often_full = jnp.mean(full.reshape(groups // partitions, -1), axis=0) >= 0.5
  return {"max_violation": (jnp.max(load) - mean) / mean,
          "dead_experts": jnp.sum(load == 0).astype(jnp.float32),
          "saturated_experts": jnp.sum(often_full).astype(jnp.float32)}


# Auxiliary-loss-free balancing (docs/routers.md).
BIAS = "balance_bias"  # the router's parameter, (E,)
LOADS = "balance_loads"  # the collection its training loads are sown in, at the bias' path
BALANCES = ("aux_loss", "bias")


def group_bias(bias: jax.Array, groups: int, partitions: int = 1) -> jax.Array:
  """(E,) bias -> (G, 1, E/P): group g routes among partition g % P's experts, with their bias."""
  return jnp.tile(bias.reshape(partitions, -1), (groups // partitions, 1))[:, None, :]


def bias_update(bias: jax.Array, loads: jax.Array, rate: float) -> jax.Array:
  """b_i + u * sign(mean_j load_j - load_i) (Wang et al. 2024, Algorithm 1), loads (P, E/P):
  the mean over each partition's experts; an expert at the mean keeps its bias."""
  loads = loads.astype(jnp.float32)
  direction = jnp.sign(jnp.mean(loads, axis=-1, keepdims=True) - loads).reshape(bias.shape)
  return bias + jnp.asarray(rate, bias.dtype) * direction.astype(bias.dtype)


def bias_param_update(rate: float) -> ParamUpdate:
  """The train step's update of every router's bias: `bias_update` at `rate` from the loads of
  the batch; a rate of 0 freezes the bias (fine-tuning's default)."""
  return ParamUpdate(param=BIAS, collection=LOADS,
                     rule=functools.partial(bias_update, rate=rate) if rate else None)
