"""Device mesh, shardings from logical axis names, multi-host start-up."""
from runner.parallel.distributed import initialize
from runner.parallel.mesh import (RULES, Placement, batch_sharding, make_mesh, mesh_shape,
                                  placement, replicated, logical_rules)

__all__ = ["RULES", "Placement", "batch_sharding", "initialize", "make_mesh", "mesh_shape",
           "placement", "replicated", "logical_rules"]
