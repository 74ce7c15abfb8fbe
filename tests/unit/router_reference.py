"""Plain NumPy / Python references for the experts-choice and Soft MoE router tests (not collected).

Written from the papers (Zhou et al. 2022, Puigcerver et al. 2023) and from the facts of the
reference code (google-research/vmoe: vmoe/moe.py `compute_capacity`,
`_get_top_items_per_expert_einsum_dispatcher`, `EinsumDispatcher`;
vmoe/projects/soft_moe/router.py `SoftRouter`), restated as loops and float64 NumPy; nothing here
calls the code under test.
"""
from __future__ import annotations

import fractions
import math

import numpy as np


def softmax(logits, axis=-1) -> np.ndarray:
  logits = np.asarray(logits, np.float64)
  if isinstance(axis, tuple):  # softmax over several axes: flatten them (they must be trailing)
    shape = logits.shape
    flat = logits.reshape(shape[:axis[0]] + (-1,))
    return softmax(flat, -1).reshape(shape)
  z = logits - logits.max(axis=axis, keepdims=True)
  ez = np.exp(z)
  return ez / ez.sum(axis=axis, keepdims=True)


def compute_capacity(num_tokens: int, num_experts: int, capacity_factor: float,
                     ceil_or_round: str = "ceil", multiple_of: int | None = 4,
                     half: str = "even") -> int:
  """The reference's capacity: ceil (or round) of num_tokens * cf / E in floating point, >= 1
  (the reference raises below 1), then raised to a multiple of `multiple_of`.

  The reference rounds with Python's `round` (`half="even"`: 2.5 -> 2); `half="up"` rounds exact
  halves up instead (the "paper" rounding of this project), computed from the decimal cf.
  """
  if ceil_or_round == "ceil":
    capacity = int(math.ceil(num_tokens * capacity_factor / num_experts))
  elif half == "even":
    capacity = int(round(num_tokens * capacity_factor / num_experts))
  else:
    exact = fractions.Fraction(str(capacity_factor)) * num_tokens / num_experts
    capacity = int(math.floor(exact + fractions.Fraction(1, 2)))
  if capacity < 1:
    raise ValueError(f"capacity {capacity} < 1")
  if multiple_of and multiple_of > 0:
    while capacity % multiple_of:
      capacity += 1
  return capacity


def is_half_tie(num_tokens: int, num_experts: int, capacity_factor: float) -> bool:
  """Whether num_tokens * cf / E is exactly an integer plus one half (where rounding rules differ)."""
  exact = fractions.Fraction(str(capacity_factor)) * num_tokens / num_experts
  return (exact - fractions.Fraction(1, 2)).denominator == 1


# ------------------------------------------------------------------------------------------------
# Experts-choice (top items per expert).
# ------------------------------------------------------------------------------------------------

def experts_choice_selection(gates: np.ndarray, capacity: int) -> list[list[int]]:
  """For ONE group, gates (S, E): expert e's tokens, the C largest gates[:, e], largest first,
  equal gates in increasing token order."""
  num_tokens, num_experts = gates.shape
  return [sorted(range(num_tokens), key=lambda t: (-float(gates[t, e]), t))[:capacity]
          for e in range(num_experts)]


def experts_choice_tensors(gates: np.ndarray, capacity: int):
  """For ONE group: (dispatch (S, E, C) one-hot, combine (S, E, C) = gate at the selected
  pairs), the reference EinsumDispatcher's weights."""
  num_tokens, num_experts = gates.shape
  dispatch = np.zeros((num_tokens, num_experts, capacity), np.float64)
  combine = np.zeros((num_tokens, num_experts, capacity), np.float64)
  for e, tokens in enumerate(experts_choice_selection(gates, capacity)):
    for c, t in enumerate(tokens):
      dispatch[t, e, c] = 1.0
      combine[t, e, c] = float(gates[t, e])
  return dispatch, combine


def einsum_dispatch(x: np.ndarray, dispatch: np.ndarray) -> np.ndarray:
  """(G, S, D) tokens, (G, S, E, C) weights -> (E, G, C, D) slots, by explicit sums."""
  g, s, d = x.shape
  _, _, e, c = dispatch.shape
  out = np.zeros((e, g, c, d), np.float64)
  for gi in range(g):
    for ei in range(e):
      for ci in range(c):
        for t in range(s):
          if dispatch[gi, t, ei, ci] != 0:
            out[ei, gi, ci] += dispatch[gi, t, ei, ci] * np.asarray(x[gi, t], np.float64)
  return out


def einsum_combine(y: np.ndarray, combine: np.ndarray) -> np.ndarray:
  """(E, G, C, D) slot outputs, (G, S, E, C) weights -> (G, S, D), by explicit sums."""
  e, g, c, d = y.shape
  s = combine.shape[1]
  out = np.zeros((g, s, d), np.float64)
  for gi in range(g):
    for t in range(s):
      for ei in range(e):
        for ci in range(c):
          out[gi, t] += combine[gi, t, ei, ci] * np.asarray(y[ei, gi, ci], np.float64)
  return out


# ------------------------------------------------------------------------------------------------
# Soft MoE.
# ------------------------------------------------------------------------------------------------

def l2_normalize(x: np.ndarray, axis: int, eps: float = 1e-6) -> np.ndarray:
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.sum(x * x, axis=axis, keepdims=True) + eps)


def soft_weights(x: np.ndarray, mu: np.ndarray, scale: float, noise: np.ndarray | None = None):
  """x (G, S, D), mu (D, E, P): (logits, dispatch, combine), each (G, S, E, P).

  logits[g, t, e, p] = scale * <x_t / |x_t|, mu_ep / |mu_ep|> (+ noise); dispatch: softmax over the
  tokens t (per slot); combine: softmax over all E * P slots (per token).
  """
  xn = l2_normalize(x, axis=-1)
  mun = l2_normalize(mu, axis=0)
  g, s, d = xn.shape
  _, e, p = mun.shape
  logits = np.zeros((g, s, e, p))
  for gi in range(g):
    for t in range(s):
      for ei in range(e):
        for pi in range(p):
          logits[gi, t, ei, pi] = scale * float(np.dot(xn[gi, t], mun[:, ei, pi]))
  if noise is not None:
    logits = logits + np.asarray(noise, np.float64).reshape(logits.shape)
  return logits, softmax(logits, axis=1), softmax(logits, axis=(2, 3))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def mlp_experts(weights, slots: np.ndarray) -> np.ndarray:
  """E two-layer GELU (tanh) MLPs; slots (E, G, C, D), expert e on slots[e]."""
  w1, b1, w2, b2 = (np.asarray(w, np.float64) for w in weights)
  out = np.zeros(slots.shape, np.float64)
  for e in range(slots.shape[0]):
    h = gelu_tanh(slots[e] @ w1[e] + b1[e])
    out[e] = h @ w2[e] + b2[e]
  return out
