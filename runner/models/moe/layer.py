"""A sparse MoE MLP block: group tokens, route, dispatch, run experts, combine.

On one device everything is plain JAX. On a mesh, routing runs data-parallel under the compiler's
partitioner, and dispatch -> experts -> combine runs under `shard_map`: each device dispatches its
own routing groups locally; when the expert weights are split over the `expert` mesh axis, an
all-to-all sends each expert's buffer slice to the device holding that expert and another brings
the outputs back. The per-device code is the single-device code.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax.linen import partitioning
from jax.sharding import PartitionSpec as P

from runner.models.moe import dispatch as dispatch_lib
from runner.models.moe.experts import LOGICAL_AXES, MlpExperts, apply_experts
from runner.models.moe.router import NoisyTopKRouter
from runner.models.moe.routing import DispatchPlan

BATCH_AXES = ("data", "expert")


def _active_mesh():
  """The mesh set by `jax.set_mesh` while tracing, or None on a single device."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty or mesh.size == 1 else mesh


def _mesh_axes(logical: tuple) -> tuple:
  """Mesh axes of one parameter under the current logical-axis rules."""
  spec = partitioning.logical_to_mesh_axes(logical)
  return tuple(spec) + (None,) * (len(logical) - len(spec))


class MoeMlpBlock(nn.Module):
  """Replaces a ViT MLP. Tokens of `group_size` consecutive images form one routing group; all
  tokens of a group compete for the same expert buffers (what Batch Prioritized Routing sorts).

  Applied with mutable=["intermediates"], it also sows `selected_experts`: (batch, tokens, k)
  int32, every token's TOP-k experts as the router chose them, before capacity drops. That is the
  "set of selected experts" whose change under attack the adversarial evaluator measures
  (Puigcerver et al. 2022, App. F): a property of the token alone, whereas what survives the
  buffers also depends on the other images of its routing group.
  """
  num_experts: int
  mlp_dim: int
  group_size: int = 8
  expert_dropout: float = 0.0
  dispatcher: str = "indices"
  router: dict | None = None  # keyword arguments of NoisyTopKRouter
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> tuple[jax.Array, dict]:
    batch, tokens, dim = x.shape
    group_size = min(self.group_size, batch)
    if batch % group_size:
      raise ValueError(f"batch size {batch} is not a multiple of the routing group size "
                       f"{group_size} images")
    groups = x.reshape(batch // group_size, group_size * tokens, dim)
    plan, metrics = NoisyTopKRouter(num_experts=self.num_experts, **(self.router or {}),
                                    name="router")(groups, train=train)
    # A no-op unless the caller made "intermediates" mutable.
    self.sow("intermediates", "selected_experts", plan.experts.reshape(batch, tokens, plan.k))
    weights = MlpExperts(self.num_experts, self.mlp_dim, name="experts")(dim)
    rng = self.make_rng("dropout") if train and self.expert_dropout else None
    mesh = _active_mesh()
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["expert"]
    if mesh is None or groups.shape[0] % shards:  # e.g. the 1-image batch of initialisation
      y = self._experts_local(groups.astype(self.dtype), plan, weights, rng, expert_axis=None)
    else:
      y = self._experts_sharded(mesh, groups.astype(self.dtype), plan, weights, rng)
    return y.reshape(batch, tokens, dim).astype(x.dtype), metrics

  def _experts_local(self, groups, plan, weights, rng, *, expert_axis):
    """Dispatch, experts, combine on this device's groups; all-to-all over `expert_axis`."""
    buffers = dispatch_lib.dispatch(groups, plan, self.dispatcher)  # (E, G, C, D)
    if expert_axis is not None:  # (E, G, C, D) -> (E / n, n * G, C, D)
      buffers = jax.lax.all_to_all(buffers, expert_axis, 0, 1, tiled=True)
    outputs = apply_experts(weights, buffers, dropout_rate=self.expert_dropout, rng=rng,
                            dtype=self.dtype)
    if expert_axis is not None:
      outputs = jax.lax.all_to_all(outputs, expert_axis, 1, 0, tiled=True)
    return dispatch_lib.combine(outputs, plan, self.dispatcher)

  def _experts_sharded(self, mesh, groups, plan, weights, rng):
    weight_axes = [_mesh_axes(axes) for axes in LOGICAL_AXES]
    expert_axis = weight_axes[0][0]  # where the expert dimension of the weights lives
    batch_spec = P(BATCH_AXES)

    use_dropout = rng is not None
    rng = rng if use_dropout else jax.random.key(0)

    def local(groups, slot_of_assignment, assignment_of_slot, combine_weights, rng, *weights):
      local_plan = DispatchPlan(slot_of_assignment, assignment_of_slot, combine_weights,
                                num_experts=plan.num_experts, capacity=plan.capacity, k=plan.k)
      # Weights sharded along other dimensions (FSDP) are gathered for the computation.
      gathered = []
      for w, axes in zip(weights, weight_axes):
        for dim, axis in enumerate(axes):
          if axis is not None and dim > 0:
            w = jax.lax.all_gather(w, axis, axis=dim, tiled=True)
        gathered.append(w)
      if use_dropout:  # different dropout masks on different devices
        for axis in BATCH_AXES:
          rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
      return self._experts_local(groups, local_plan, gathered, rng if use_dropout else None,
                                 expert_axis=expert_axis)

    in_specs = (batch_spec, batch_spec, batch_spec, batch_spec, P(),
                *(P(*axes) for axes in weight_axes))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=batch_spec)(
        groups, plan.slot_of_assignment, plan.assignment_of_slot, plan.combine_weights, rng,
        *weights)
