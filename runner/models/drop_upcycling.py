"""Drop-Upcycling (Nakamura et al., ICLR 2025, arXiv 2502.19261): sparse upcycling copies a dense
model's MLP into every expert, then each expert re-initialises a random fraction r of the MLP's
intermediate dimensions (the first kernel's columns, the second's rows) from a normal with the
mean and standard deviation of the dense matrix they replace: the experts start diverse and keep
most of what the dense model learned (r = 0.5 was the paper's best). The paper's MLPs have no
biases: here the first bias at the chosen dimensions is drawn likewise from the dense bias's
statistics, and the second's (one value per output, shared by every dimension) is kept."""
from __future__ import annotations

import numpy as np


def drop_upcycle(experts: dict, ratio: float, rng: np.random.Generator) -> dict:
  """`experts`: fc1_kernel (E, D, F), fc1_bias (E, F), fc2_kernel (E, F, D), fc2_bias (E, D), each
  expert a copy of the dense MLP; returns them with each expert's own dropped dimensions drawn."""
  w1, b1, w2 = (np.array(experts[k], copy=True) for k in ("fc1_kernel", "fc1_bias", "fc2_kernel"))
  count = int(ratio * w1.shape[-1])  # floor(r * F)
  (m1, s1), (mb, sb), (m2, s2) = ((np.mean(m[0]), np.std(m[0])) for m in (w1, b1, w2))
  for e in range(w1.shape[0]):
    dims = rng.choice(w1.shape[-1], size=count, replace=False)
    w1[e][:, dims] = rng.normal(m1, s1, size=(w1.shape[1], count))
    b1[e][dims] = rng.normal(mb, sb, size=count)
    w2[e][dims, :] = rng.normal(m2, s2, size=(count, w2.shape[2]))
  return {**experts, "fc1_kernel": w1, "fc1_bias": b1, "fc2_kernel": w2}
