"""Device mesh and shardings from logical axis names."""
from runner.parallel.mesh import (batch_sharding, make_mesh, replicated, shardings_from_logical,
                                  with_rules)

__all__ = ["batch_sharding", "make_mesh", "replicated", "shardings_from_logical", "with_rules"]
