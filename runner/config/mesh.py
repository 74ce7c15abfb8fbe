"""What `mesh.*` and `sharding.*` may say: the mesh's axes, the rule bundles `sharding.name`
chooses, and the shape that `mesh.data` / `mesh.expert` resolve to for a device count: no JAX, so
that a config is checked without building anything.
"""
from __future__ import annotations

import math

from runner.errors import ConfigError

MESH_AXES = ("data", "expert")

# Ready-made rule bundles (conf/sharding/*.yaml carry the same lists): logical axis -> mesh axis.
RULES = {
    "dp": (),
    "ep": (("expert", "expert"),),
    "fsdp_ep": (("expert", "expert"), ("embed", "data")),
}


def expert_mesh_axes(bundle: str, rules: list | None = None) -> tuple[str, ...]:
  """The mesh axes the experts' weights are split over, as the rules map their logical `expert`
  axis (the first rule naming it, as flax reads them; explicit `rules` replace the bundle's);
  () where the experts are replicated (sharding=dp)."""
  for logical, axes in (rules if rules is not None else RULES.get(bundle, ())):
    if logical == "expert":
      axes = [axes] if isinstance(axes, str) or axes is None else axes
      return tuple(a for a in axes if a is not None)
  return ()


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
