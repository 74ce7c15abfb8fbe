"""Mesh creation and logical-axis rules: model code names axes, a rule set maps them to the mesh.
The batch splits over both mesh axes, `data` and `expert`; parameters are replicated unless a rule
maps one of their logical axes to a mesh axis: `expert` -> `expert` shards expert weights (expert
parallelism), `embed` -> `data` shards each weight matrix along its embedding axis (fully-sharded
data parallelism). Axes, rule bundles and mesh shape are config values (runner/config/mesh.py)."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Iterator

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from runner.config.mesh import MESH_AXES, RULES, mesh_shape
from runner.errors import ConfigError

BATCH_AXES = ("data", "expert")


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

  def prefetch(self, batches: Iterator[dict], size: int = 2) -> Iterator[dict]:
    """The batches put on the devices `size` - 1 ahead of their use: JAX copies a batch to the
    devices asynchronously, so each one's copy overlaps the steps dispatched before it."""
    queue = collections.deque()
    for batch in batches:
      queue.append(self.put(batch))
      if len(queue) >= size:
        yield queue.popleft()
    yield from queue

  def shardings(self, logical_specs):
    """A tree of NamedShardings from a tree of logical PartitionSpecs (flax metadata)."""
    return nn.logical_to_mesh_sharding(logical_specs, self.mesh, self.rules)

  @contextlib.contextmanager
  def context(self):
    """Context in which model code sees the mesh and the logical-axis rules."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield


def placement(data: int = -1, expert: int = 1, rules: tuple = (),
              num_experts: int = 0) -> Placement:
  """A mesh of `data` x `expert` devices (-1: inferred) with these logical-axis rules."""
  return Placement(make_mesh(data, expert, num_experts=num_experts), tuple(rules))
