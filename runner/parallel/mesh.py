"""Mesh creation and logical-axis rules: model code names axes, a rule set maps them to the mesh.

Mesh axes: `data` and `expert`. The batch is split over both (every device sees different images);
expert weights are split over `expert` only. Rule sets are lists of (logical name, mesh axis).
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np
import flax.linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "expert")
BATCH_AXES = ("data", "expert")

# Pure data parallelism: every parameter replicated.
DP_RULES = (("batch", BATCH_AXES),)


def make_mesh(data: int = -1, expert: int = 1, devices=None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  if data == -1:
    data = n // expert
  if data * expert != n:
    raise ValueError(f"mesh data={data} x expert={expert} does not use the {n} devices")
  return Mesh(np.asarray(devices).reshape(data, expert), MESH_AXES)


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
  """Context in which `nn.with_logical_constraint` in model code resolves against `mesh`."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield
