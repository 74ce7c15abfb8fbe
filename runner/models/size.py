"""A model's size in parameters: all of them, and those one token uses (V-MoE's "active"
parameters). Counted from the shapes, so abstract parameters (`jax.eval_shape`) count as well."""
from __future__ import annotations

import jax
import numpy as np


def count_params(params) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


def active_params(params, num_experts: int, k: float) -> int:
  """Parameters one token uses: the experts count k / E of their weights (V-MoE's "active"); k may
  be fractional (experts-choice routing: E * capacity / tokens on average). For a partitioned batch
  ensemble pass E / M: a member's token chooses among its partition."""
  e = num_experts
  sizes = [(int(np.prod(leaf.shape)), [getattr(p, "key", str(p)) for p in path])
           for path, leaf in jax.tree_util.tree_leaves_with_path(params)]
  return sum(round(size * min(k, e) / e) if e and "experts" in names else size
             for size, names in sizes)
