"""A sparse MoE MLP block: group tokens, route, dispatch, run experts, combine.

On a mesh, routing runs data-parallel under the compiler's partitioner, and dispatch -> experts ->
combine under `shard_map`, each device on its own routing groups with the single-device code;
with the expert weights split over the `expert` mesh axis, an all-to-all sends each expert's
buffer slice to the device holding it and another brings the outputs back. A dropless plan
(`plan.ragged`) has no buffers: grouped matmuls on the assignments sorted by expert, replicated on
a mesh, as a varying count of rows per expert cannot go through the all-to-all."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax.linen import partitioning
from jax.sharding import PartitionSpec as P

from runner.accelerator import compute_device, grouped_matmul_problem
from runner.errors import ConfigError
from runner.models.moe import grouped_matmul, routers
from runner.models.moe.experts import (LOGICAL_AXES, SHARED_AXES, MlpExperts, apply_experts,
                                       apply_experts_ragged)

BATCH_AXES = ("data", "expert")


def _active_mesh():
  """The mesh set by `jax.set_mesh` while tracing, or None on a single device."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty or mesh.size == 1 else mesh


def _mesh_axes(logical: tuple) -> tuple:
  """Mesh axes of one parameter under the current logical-axis rules."""
  spec = partitioning.logical_to_mesh_axes(logical)
  return tuple(spec) + (None,) * (len(logical) - len(spec))


def _partition_major(buffers: jax.Array, partitions: int) -> jax.Array:
  """(E/P, G*P, C, D) buffers of per-partition plans -> (E, G, C, D), expert p*E/P + e."""
  experts, blocks, capacity, dim = buffers.shape
  g = blocks // partitions
  return buffers.reshape(experts, g, partitions, capacity, dim).transpose(2, 0, 1, 3, 4).reshape(
      partitions * experts, g, capacity, dim)


def _partition_blocks(outputs: jax.Array, partitions: int) -> jax.Array:
  """The inverse of `_partition_major`."""
  experts, g, capacity, dim = outputs.shape
  e = experts // partitions
  return outputs.reshape(partitions, e, g, capacity, dim).transpose(1, 2, 0, 3, 4).reshape(
      e, g * partitions, capacity, dim)


class MoeMlpBlock(nn.Module):
  """Replaces a ViT MLP. Tokens of `group_size` consecutive images form one routing group, whose
  tokens compete for the same expert buffers (what Batch Prioritized Routing sorts). The router
  is the family `router["type"]` names (the schema's default when absent).

  A partitioned batch ensemble (`ensemble_size` M > 1, Allingham et al.; only families that
  `supports_ensembles`) splits the E experts into M partitions of E/M, one per member:
  - "pbe": rows are tiled, image-major (row b*M + m is member m's copy of image b, as
    `jnp.repeat`); a routing group holds `group_size` images x M copies, and member m's tokens are
    routed among its partition's experts only, by its own router columns.
  - "tiling_only": tiled rows, one router over all E experts (the ablation without partitions).
  - "partition_only": rows are not tiled; each token is routed in every partition (k experts in
    each) and the M partitions' outputs are summed (the ablation without tiling).

  With mutable=["intermediates"] it sows the records runner/models/introspection.py lists (global
  ids; partition_only puts every token's M partitions side by side). The chosen set depends on the
  token alone, what survives the buffers on its group's other images too: PGD's default protocol
  compares the former, the reference code the latter.

  The `shared_experts` (DeepSeekMoE, docs/routers.md) are separate MLPs, parameters `shared/`
  shaped like `experts/` with a leading axis of K_s, replicated over the devices (SHARED_AXES)."""
  num_experts: int
  mlp_dim: int
  group_size: int = 8
  expert_dropout: float = 0.0
  dispatcher: str = "indices"
  grouped_matmul: str = "auto"  # dropless plans: grouped_matmul.py's method
  router: dict | None = None  # "type" (a router family) and its module's keyword arguments
  ensemble_size: int = 1
  ensemble_variant: str = "pbe"
  shared_experts: int = 0  # DeepSeekMoE's shared experts, applied to every token
  dtype: jnp.dtype = jnp.float32
  activation: str = "gelu_tanh"  # the experts' nonlinearity (runner/models/activations.py)

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool,
               dropout: bool | None = None) -> tuple[jax.Array, dict]:
    """`dropout` (default: `train`) turns expert dropout on; MC-dropout sets it at inference."""
    rows, tokens, dim = x.shape
    m = self.ensemble_size
    tiled = m > 1 and self.ensemble_variant in ("pbe", "tiling_only")
    images = rows // m if tiled else rows
    group_size = min(self.group_size, images)
    if images % group_size or (tiled and rows % m):
      raise ValueError(f"batch size {images} is not a multiple of the routing group size "
                       f"{group_size} images")
    num_groups = images // group_size
    partitioned = m > 1 and self.ensemble_variant in ("pbe", "partition_only")
    partitions = m if partitioned else 1
    if not partitioned:  # rows of a group are consecutive: images (and their copies)
      blocks = x.reshape(num_groups, rows // num_groups * tokens, dim)
    elif tiled:  # pbe: (G, images, M, T, D) -> member blocks (G*M, images*T, D)
      blocks = x.reshape(num_groups, group_size, m, tokens, dim).transpose(0, 2, 1, 3, 4)
      blocks = blocks.reshape(num_groups * m, group_size * tokens, dim)
    else:  # partition_only: every group once per partition
      groups = x.reshape(num_groups, 1, group_size * tokens, dim)
      blocks = jnp.broadcast_to(groups, (num_groups, m, group_size * tokens, dim)).reshape(
          num_groups * m, group_size * tokens, dim)
    options = dict(self.router or {})
    family = routers.family(options.pop("type", None))
    if family.supports_ensembles:
      options["partitions"] = partitions
    elif m > 1:
      raise ValueError(f"router type {family.name!r} does not form partitioned batch ensembles")
    plan, metrics = family.module(num_experts=self.num_experts, **options, name="router")(
        blocks, train=train)
    self._sow_routing(family, plan, num_groups, group_size, tokens, partitions, tiled)
    weights = MlpExperts(self.num_experts, self.mlp_dim, name="experts")(dim)
    dropout = train if dropout is None else dropout
    rng = self.make_rng("dropout") if dropout and self.expert_dropout else None
    mesh = _active_mesh()
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["expert"]
    blocks = blocks.astype(self.dtype)
    if mesh is None or num_groups % shards:  # e.g. the 1-image batch of initialisation
      y = self._experts_local(blocks, plan, weights, rng, partitions, expert_axis=None)
    else:
      y = self._experts_sharded(mesh, blocks, plan, weights, rng, partitions)
    if not partitioned:
      y = y.reshape(rows, tokens, dim)
    elif tiled:
      y = y.reshape(num_groups, m, group_size, tokens, dim).transpose(0, 2, 1, 3, 4)
      y = y.reshape(rows, tokens, dim)
    else:
      y = y.reshape(num_groups, m, group_size * tokens, dim).sum(axis=1).reshape(rows, tokens, dim)
    if self.shared_experts:
      y = y + self._shared(x, dropout)
    return y.astype(x.dtype), metrics

  def _shared(self, x: jax.Array, dropout: bool) -> jax.Array:
    """The sum of the K_s shared experts' MLPs, each applied to every token: (rows, T, D)."""
    rows, tokens, dim = x.shape
    k = self.shared_experts
    weights = MlpExperts(k, self.mlp_dim, logical_axes=SHARED_AXES, name="shared")(dim)
    rng = self.make_rng("dropout") if dropout and self.expert_dropout else None
    every = jnp.broadcast_to(x.astype(self.dtype).reshape(1, 1, rows * tokens, dim),
                             (k, 1, rows * tokens, dim))  # each shared expert takes every token
    y = apply_experts(weights, every, dropout_rate=self.expert_dropout, rng=rng, dtype=self.dtype,
                      activation=self.activation)
    return y.sum(axis=0).reshape(rows, tokens, dim)

  def _per_image(self, values, num_groups, group_size, tokens, partitions, tiled) -> jax.Array:
    """(G*P, S, E/P) per-block values -> (images, rows, E) over the global experts, zero outside
    a member's partition: (images, M*T, E) tiled, (images, T, E) for partition_only."""
    images = num_groups * group_size
    if partitions == 1:  # rows of a tiled batch are image-major: one image's copies are adjacent
      return values.reshape(images, -1, values.shape[-1])
    m, e = partitions, self.num_experts // partitions
    values = values.reshape(num_groups, m, group_size, tokens, e)
    if not tiled:  # (G, M, images, T, E/M) -> (images, T, E): the partitions' columns in order
      return values.transpose(0, 2, 3, 1, 4).reshape(images, tokens, m * e)
    full = jnp.zeros((num_groups, m, group_size, tokens, m * e), values.dtype)
    for member in range(m):
      full = full.at[:, member, ..., member * e:(member + 1) * e].set(values[:, member])
    return full.transpose(0, 2, 1, 3, 4).reshape(images, m * tokens, m * e)

  def _sow_routing(self, family, plan, num_groups, group_size, tokens, partitions, tiled):
    """What the routing decided (the class docstring); a no-op unless "intermediates" is mutable."""
    layout = (num_groups, group_size, tokens, partitions, tiled)
    self.sow("intermediates", "expert_weights", self._per_image(plan.expert_weights(), *layout))
    for name, values in family.sown_records(plan).items():
      if partitions > 1:
        raise ValueError(f"router type {family.name!r} sows {name!r}, which a partitioned batch "
                         "ensemble cannot lay out per image")
      self.sow("intermediates", name, self._per_image(values, *layout))  # (images, tokens, N)
    for name, routed in (("selected_experts", False), ("routed_experts", True)):
      if (ids := family.expert_ids(plan, routed)) is not None:
        self.sow("intermediates", name, self._per_image_ids(ids, *layout))
    if family.discrete:
      for name, routed in (("expert_mask", False), ("routed_mask", True)):
        self.sow("intermediates", name, self._per_image(plan.expert_mask(routed), *layout))

  def _per_image_ids(self, ids, num_groups, group_size, tokens, partitions, tiled) -> jax.Array:
    """(G*P, S, k) expert ids of each block's plan (-1: none) -> global expert ids per image:
    (images, M*T, k) for tiled rows, (images, T, M*k) for partition_only."""
    images, k = num_groups * group_size, ids.shape[-1]
    if partitions == 1:  # rows of a tiled batch are image-major: one image's copies are adjacent
      return ids.reshape(images, -1, k)
    m = partitions
    ids = ids.reshape(num_groups, m, group_size, tokens, k)
    first = (jnp.arange(m) * (self.num_experts // m))[None, :, None, None, None]
    ids = jnp.where(ids >= 0, ids + first, -1)  # the partition's first expert id
    if tiled:  # (G, M, images, T, k) -> (images, M*T, k)
      return ids.transpose(0, 2, 1, 3, 4).reshape(images, m * tokens, k)
    return ids.transpose(0, 2, 3, 1, 4).reshape(images, tokens, m * k)

  def _experts_local(self, blocks, plan, weights, rng, partitions, *, expert_axis):
    """Dispatch, experts, combine on this device's groups; all-to-all over `expert_axis`."""
    if getattr(plan, "ragged", False):
      return self._experts_ragged(blocks, plan, weights, rng, partitions, expert_axis=expert_axis)
    buffers = plan.dispatch(blocks, self.dispatcher)  # (E/P, G*P, C, D)
    if partitions > 1:
      buffers = _partition_major(buffers, partitions)  # (E, G, C, D)
    if expert_axis is not None:  # (E, G, C, D) -> (E / n, n * G, C, D)
      buffers = jax.lax.all_to_all(buffers, expert_axis, 0, 1, tiled=True)
    outputs = apply_experts(weights, buffers, dropout_rate=self.expert_dropout, rng=rng,
                            dtype=self.dtype, activation=self.activation)
    if expert_axis is not None:
      outputs = jax.lax.all_to_all(outputs, expert_axis, 1, 0, tiled=True)
    if partitions > 1:
      outputs = _partition_blocks(outputs, partitions)
    return plan.combine(outputs, self.dispatcher)

  def _experts_ragged(self, blocks, plan, weights, rng, partitions, *, expert_axis):
    """A dropless plan on this device's groups: the assignments' tokens sorted by expert, one
    grouped matmul per layer, weighted back into their tokens."""
    if partitions > 1 or expert_axis is not None:
      raise ValueError("dropless routing runs with every expert on every device and without "
                       "ensemble partitions: its rows sorted by expert vary in number per "
                       "expert, which the all-to-all of expert parallelism cannot exchange")
    problem = grouped_matmul_problem(grouped_matmul.resolve(self.grouped_matmul),
                                     jnp.dtype(self.dtype).name, compute_device()["platform"])
    if problem:  # when traced: before anything is compiled or computed
      raise ConfigError(problem)
    layout = plan.layout()
    outputs = apply_experts_ragged(weights, plan.rows(blocks, layout), layout.experts,
                                   layout.group_sizes, dropout_rate=self.expert_dropout, rng=rng,
                                   dtype=self.dtype, method=self.grouped_matmul,
                                   activation=self.activation)
    return plan.combine_rows(outputs, layout)

  def _experts_sharded(self, mesh, groups, plan, weights, rng, partitions):
    weight_axes = [_mesh_axes(axes) for axes in LOGICAL_AXES]
    expert_axis = weight_axes[0][0]  # where the expert dimension of the weights lives
    batch_spec = P(BATCH_AXES)

    use_dropout = rng is not None
    rng = rng if use_dropout else jax.random.key(0)

    def local(groups, local_plan, rng, *weights):
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
                                 partitions, expert_axis=expert_axis)

    # Every array of a plan has the groups first: each device takes its groups' share.
    in_specs = (batch_spec, batch_spec, P(), *(P(*axes) for axes in weight_axes))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=batch_spec)(
        groups, plan, rng, *weights)
