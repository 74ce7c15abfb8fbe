"""Mesh creation and logical-axis rules: model code names axes, a rule set maps them to the mesh.

Mesh axes: `data` and `expert`. The batch is split over both (every device sees different images);
parameters are replicated unless a rule maps one of their logical axes to a mesh axis:
`expert` -> `expert` shards expert weights (expert parallelism), `embed` -> `data` shards every
weight matrix along its embedding dimension (fully-sharded data parallelism).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from runner.errors import ConfigError

MESH_AXES = ("data", "expert")
BATCH_AXES = ("data", "expert")

# Ready-made rule bundles (conf/sharding/*.yaml carry the same lists).
RULES = {
    "dp": (),
    "ep": (("expert", "expert"),),
    "fsdp_ep": (("expert", "expert"), ("embed", "data")),
}


def mesh_shape(data: int, expert: int, num_devices: int, num_experts: int = 0) -> tuple[int, int]:
  """Resolves -1 entries: expert=-1 takes the most devices that divide both the device count and
  the number of experts; data=-1 takes the rest. Errors name the numbers that do not fit."""
  if expert == -1:
    expert = math.gcd(num_devices, num_experts) if num_experts else 1
  if expert < 1 or (data != -1 and data < 1):
    raise ConfigError(f"mesh.data={data} and mesh.expert={expert} must be positive (or -1 to "
                      "infer).")
  if data == -1:
    if num_devices % expert:
      raise ConfigError(f"mesh.expert={expert} does not divide the {num_devices} devices; use a "
                        f"divisor of {num_devices}.")
    data = num_devices // expert
  if data * expert != num_devices:
    raise ConfigError(f"a mesh of mesh.data={data} x mesh.expert={expert} = {data * expert} "
                      f"devices does not match the {num_devices} devices available; their "
                      "product must equal the device count (set one of them to -1 to infer it).")
  if num_experts and expert > 1 and num_experts % expert:
    raise ConfigError(f"model.moe.num_experts={num_experts} is not divisible by the expert axis "
                      f"mesh.expert={expert}; use an expert axis that divides {num_experts}.")
  return data, expert


def make_mesh(data: int = -1, expert: int = 1, devices=None, num_experts: int = 0) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  data, expert = mesh_shape(data, expert, len(devices), num_experts)
  return Mesh(np.asarray(devices).reshape(data, expert), MESH_AXES)


def logical_rules(bundle: str = "dp", explicit: list | None = None) -> tuple:
  """The logical-axis rules: an explicit [[logical axis, mesh axis], ...] list, else a bundle."""
  if explicit is not None:
    return tuple((str(a), None if b is None else (tuple(b) if isinstance(b, list) else str(b)))
                 for a, b in explicit)
  if bundle not in RULES:
    raise ConfigError(f"unknown sharding bundle {bundle!r}; valid: {', '.join(RULES)}.")
  return RULES[bundle]


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over every device."""
  return NamedSharding(mesh, P(BATCH_AXES))


def shardings_from_logical(logical_specs, mesh: Mesh, rules) -> object:
  """A tree of NamedShardings from a tree of logical PartitionSpecs (flax metadata)."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


@contextlib.contextmanager
def with_rules(mesh: Mesh, rules):
  """Context in which model code sees the mesh and the logical-axis rules."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where things live: the mesh, the logical-axis rules, and how host batches become global."""
  mesh: Mesh
  rules: tuple

  @property
  def batch_sharding(self) -> NamedSharding:
    return batch_sharding(self.mesh)

  def put(self, batch: dict) -> dict:
    """This process's rows of a batch -> global arrays split over the batch axes."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), batch)

  def shardings(self, logical_specs):
    return shardings_from_logical(logical_specs, self.mesh, self.rules)

  def context(self):
    return with_rules(self.mesh, self.rules)


def placement(data: int = -1, expert: int = 1, rules: tuple = (),
              num_experts: int = 0) -> Placement:
  """A mesh of `data` x `expert` devices (-1: inferred) with these logical-axis rules."""
  return Placement(make_mesh(data, expert, num_experts=num_experts), tuple(rules))
