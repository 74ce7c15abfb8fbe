"""The reference models' forward pass in NumPy, on their own parameter names, for parity tests.

Written from the reference code, not from this project's: google-research/vmoe
(vmoe/nn/vit_moe.py, vit_moe_ensemble.py, ensemble_routing.py, routing.py, moe.py,
projects/soft_moe/router.py), vision_transformer (vit_jax/models_vit.py) and big_vision
(big_vision/models/vit.py), with flax's nn.Conv, nn.LayerNorm, nn.MultiHeadDotProductAttention and
nn.gelu. Inference only: no dropout, no router noise (their routers are deterministic at
evaluation):

* patch embedding: a VALID convolution with stride = kernel size (p, p);
* vmoe / vision_transformer: class token concatenated first, then `posembed_input` (N+1 rows)
  added to every token; big_vision: `pos_embedding` (N rows) added to the patches, then the class
  token concatenated (it gets no position);
* pre-LN encoder blocks: x + Attention(LN(x)), then x + MLP(LN(x)); LayerNorm epsilon 1e-6
  (flax's default), biased variance;
* attention: per-head q, k, v of kernels (D, H, hd); with `query_ln` / `key_ln` in the tree
  (flax's `normalize_qk=True`) q and k each go through a LayerNorm over the hd dimensions of each
  head (mean subtracted, epsilon 1e-6, a scale (hd,) and no bias) right after their projection;
  then q scaled by hd**-0.5, softmax over keys, output kernel (H, hd, D);
* MLP: Dense_0, GELU (flax nn.gelu's default, the tanh approximation), Dense_1;
* MoE (vmoe `MlpMoeBlock`): the (rows, T, D) tokens reshaped to groups of `group_size` tokens
  (consecutive rows; default: one row, i.e. one image, per group), each group routed alone:
  - token-choice (`NoisyTopExpertsPerItemRouter`): router logits x @ W (no bias), softmax over
    the E experts, the top-k experts by gate, their outputs summed weighted by the gates
    themselves (not renormalised; the dispatcher uses the gates as combine weights). Capacities
    are taken large enough that no token is dropped, so every token reaches its top-k experts;
  - experts-choice (`NoisyTopItemsPerExpertRouter`, moe.py `get_top_items_per_expert_dispatcher`):
    the same gates; expert e processes the C tokens of the group with the largest gate[:, e]
    (`lax.top_k` per expert: ties to the lower token index), C = `compute_capacity(group tokens,
    E, capacity_factor, ceil_or_round, multiple_of)`; a (token, expert) pair's combine weight is
    its gate: a token gets 0 to E experts' outputs;
  - Soft MoE (`SoftRouter`, recognised by `Moe/Router/mu` (D, E, P) in the tree): tokens and mu
    L2-normalised (x * rsqrt(sum x^2 + 1e-6), mu over D), logits scale * <x_t, mu_{e,p}>, dispatch
    weights a softmax over the group's tokens for each slot, combine weights a softmax over all
    E*P slots for each token; slot (e, p) = sum_t dispatch[t, e, p] x_t of the unnormalised tokens,
    expert e's MLP on its P slots, token t = sum_{e,p} combine[t, e, p] y_{e,p}. The reference
    wraps its dispatcher in `Bfloat16Dispatcher` (tokens and experts' outputs rounded to bfloat16
    before the two mixing einsums, the weights kept in float32): `bfloat16_dispatch=True` does the
    same (also for experts-choice, whose dispatcher has that option); False mixes at full
    precision (what a float32 model of this project does);
* E³ (vit_moe_ensemble): before the first MoE block the batch is repeated M times with
  np.repeat (row b*M + m is member m's copy of image b); member m's tokens are routed by the
  m-th slice of the router kernel (D, M, E/M), softmax over its E/M experts only, among the
  experts m*E/M .. (m+1)*E/M - 1; the model returns the (B*M, C) member logits;
* encoder norm, pooling (class token, mean of tokens, or MAP head, whose attention has its own
  query_ln / key_ln in a vmoe qk-norm model), optional pre_logits + tanh, head.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

LN_EPS = 1e-6


def _strip(params: dict) -> dict:
  if any(k.startswith("params/") for k in params):
    return {k[len("params/"):]: v for k, v in params.items() if k.startswith("params/")}
  return dict(params)


def _unscan(params: dict) -> dict:
  out = {}
  for name, value in params.items():
    if name.startswith("Transformer/encoderblock/"):
      rest = name[len("Transformer/encoderblock/"):]
      for i in range(value.shape[0]):
        out[f"Transformer/encoderblock_{i}/{rest}"] = value[i]
    else:
      out[name] = value
  return out


def gelu(x):
  """flax.linen.gelu(x) with approximate=True (its default)."""
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, p: dict, scope: str):
  mean = x.mean(axis=-1, keepdims=True)
  var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
  return (x - mean) / np.sqrt(var + LN_EPS) * p[f"{scope}/scale"] + p[f"{scope}/bias"]


def dense(x, p: dict, scope: str):
  return x @ p[f"{scope}/kernel"] + p[f"{scope}/bias"]


def softmax(x, axis=-1):
  z = np.exp(x - x.max(axis=axis, keepdims=True))
  return z / z.sum(axis=axis, keepdims=True)


def layer_norm_no_bias(x, scale):
  """flax nn.LayerNorm(use_bias=False) over the last axis: centred, epsilon 1e-6, scaled."""
  mean = x.mean(axis=-1, keepdims=True)
  var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
  return (x - mean) / np.sqrt(var + LN_EPS) * scale


def attention(q_in, kv_in, p: dict, scope: str):
  """flax MultiHeadDotProductAttention: (B, Tq, D), (B, Tk, D) -> (B, Tq, D)."""
  def project(x, name):  # (B, T, D) x (D, H, hd) -> (B, T, H, hd)
    return np.einsum("btd,dhk->bthk", x, p[f"{scope}/{name}/kernel"]) + p[f"{scope}/{name}/bias"]
  q, k, v = project(q_in, "query"), project(kv_in, "key"), project(kv_in, "value")
  if f"{scope}/query_ln/scale" in p:  # normalize_qk=True: LayerNorms named query_ln, key_ln
    q = layer_norm_no_bias(q, p[f"{scope}/query_ln/scale"])
    k = layer_norm_no_bias(k, p[f"{scope}/key_ln/scale"])
  q = q / math.sqrt(q.shape[-1])
  w = softmax(np.einsum("bqhk,bshk->bhqs", q, k), axis=-1)
  o = np.einsum("bhqs,bshk->bqhk", w, v)
  return np.einsum("bqhk,hkd->bqd", o, p[f"{scope}/out/kernel"]) + p[f"{scope}/out/bias"]


def mlp(x, p: dict, scope: str):
  return dense(gelu(dense(x, p, f"{scope}/Dense_0")), p, f"{scope}/Dense_1")


def conv_patches(images, kernel, bias):
  """nn.Conv(kernel_size=(p, p), strides=(p, p), padding='VALID') -> (B, h*w, D), row-major grid."""
  p = kernel.shape[0]
  b, hh, ww, _ = images.shape
  gh, gw = hh // p, ww // p
  out = np.zeros((b, gh, gw, kernel.shape[-1]), dtype=np.result_type(images, kernel))
  for i in range(p):
    for j in range(p):
      # Input pixel (y*p + i, x*p + j) meets kernel tap (i, j) for output position (y, x).
      out += images[:, i:gh * p:p, j:gw * p:p, :] @ kernel[i, j]
  return (out + bias).reshape(b, gh * gw, -1)


def compute_capacity(num_tokens: int, num_experts: int, capacity_factor: float,
                     ceil_or_round: str = "ceil", multiple_of: int | None = 4) -> int:
  """vmoe/moe.py `compute_capacity`: ceil (or Python's round, halves to even) of
  tokens * factor / experts, an error below 1, then up to a multiple of `multiple_of`."""
  if ceil_or_round == "ceil":
    capacity = int(math.ceil(num_tokens * capacity_factor / num_experts))
  elif ceil_or_round == "round":
    capacity = int(round(num_tokens * capacity_factor / num_experts))
  else:
    raise ValueError(f"Unsupported {ceil_or_round=}")
  if capacity < 1:
    raise ValueError(f"capacity {capacity} < 1 for {num_tokens} tokens, {num_experts} experts and "
                     f"capacity_factor {capacity_factor}")
  if multiple_of and multiple_of > 0:
    capacity += (-capacity) % multiple_of
  return capacity


def _experts(x, p: dict, scope: str, e: int):
  """Expert e's MLP (vmapped `Mlp`, experts on axis 0) on (..., D)."""
  w1, b1 = p[f"{scope}/Mlp/Dense_0/kernel"][e], p[f"{scope}/Mlp/Dense_0/bias"][e]
  w2, b2 = p[f"{scope}/Mlp/Dense_1/kernel"][e], p[f"{scope}/Mlp/Dense_1/bias"][e]
  return gelu(x @ w1 + b1) @ w2 + b2


def _groups(x, group_size: int | None):
  """(rows, T, D) -> (groups, group_size, D), as MlpMoeBlock's reshape (default: one row)."""
  rows, tokens, d = x.shape
  group_size = group_size or tokens
  if (rows * tokens) % group_size:
    raise ValueError(f"{rows * tokens} tokens do not split into groups of {group_size}")
  return x.reshape(-1, group_size, d)


def experts_choice_moe(x, p: dict, scope: str, *, group_size: int | None, capacity_factor: float,
                       ceil_or_round: str, multiple_of: int | None, bfloat16_dispatch: bool,
                       trace: dict | None):
  """NoisyTopItemsPerExpertRouter + its einsum dispatcher: every expert takes its top-C tokens
  of each group, combine weight = gate (`bfloat16_dispatch`: the dispatcher option `bfloat16`,
  which the soft_moe project's experts-choice configs set). x: (rows, T, D)."""
  groups = _groups(x, group_size)
  num_groups, s, d = groups.shape
  router = p[f"{scope}/Router/dense/kernel"].reshape(d, -1)
  num_experts = router.shape[-1]
  capacity = compute_capacity(s, num_experts, capacity_factor, ceil_or_round, multiple_of)
  if capacity > s:  # lax.top_k of more items than the group has fails in the reference
    raise ValueError(f"capacity {capacity} > {s} tokens per group")
  y = np.zeros_like(groups)
  processed = np.zeros((num_groups, s), bool)
  for g in range(num_groups):
    gates = softmax(groups[g] @ router)  # (S, E)
    order = np.argsort(-gates.T, axis=-1, kind="stable")  # (E, S); ties: the lower token first
    if trace is not None and capacity < s:
      top = np.take_along_axis(gates.T, order, axis=-1)
      margin = float((top[:, capacity - 1] - top[:, capacity]).min())
      trace["min_gate_margin"] = min(trace.get("min_gate_margin", np.inf), margin)
    for e in range(num_experts):
      picked = order[e, :capacity]
      data = groups[g, picked]
      out = _experts(_bfloat16(data) if bfloat16_dispatch else data, p, scope, e)
      y[g, picked] += gates[picked, e, None] * (_bfloat16(out) if bfloat16_dispatch else out)
      processed[g, picked] = True
  if trace is not None:
    trace.setdefault("capacity", []).append(capacity)
    trace.setdefault("fraction_processed_tokens", []).append(float(processed.mean()))
  return y.reshape(x.shape)


def _bfloat16(x):
  """Rounded to bfloat16 (round to nearest even) and back, as Bfloat16Dispatcher's cast."""
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(x.dtype)


def soft_moe(x, p: dict, scope: str, *, group_size: int | None, bfloat16_dispatch: bool,
             trace: dict | None):
  """SoftRouter + EinsumDispatcher: slots mix the group's tokens, tokens mix every slot."""
  groups = _groups(x, group_size)
  mu, scale = p[f"{scope}/Router/mu"], p[f"{scope}/Router/scale"]  # (D, E, P), ()
  _, num_experts, num_slots = mu.shape

  def normalize(v, axis):
    return v / np.sqrt((v ** 2).sum(axis=axis, keepdims=True) + 1e-6)

  logits = scale * np.einsum("gmd,dnp->gmnp", normalize(groups, -1), normalize(mu, 0))
  dispatch = softmax(logits, axis=1)  # over the group's tokens, for each slot
  g, m = logits.shape[:2]
  combine = softmax(logits.reshape(g, m, -1), axis=-1).reshape(logits.shape)  # over all slots
  data = _bfloat16(groups) if bfloat16_dispatch else groups
  slots = np.einsum("gmnp,gmd->gnpd", dispatch, data)  # (G, E, P, D)
  out = np.stack([_experts(slots[:, e], p, scope, e) for e in range(num_experts)], axis=1)
  if bfloat16_dispatch:
    out = _bfloat16(out)
  if trace is not None:
    trace.setdefault("slots", []).append(num_slots)
  return np.einsum("gmnp,gnpd->gmd", combine, out).reshape(x.shape)


def moe(x, p: dict, scope: str, *, k: int, members: int, trace: dict | None):
  """The MoE MLP of a block, every token reaching its top-k experts. x: (rows, T, D); with
  `members` M > 1, row r belongs to member r % M (rows repeated image-major)."""
  rows, tokens, d = x.shape
  w1, b1 = p[f"{scope}/Mlp/Dense_0/kernel"], p[f"{scope}/Mlp/Dense_0/bias"]
  w2, b2 = p[f"{scope}/Mlp/Dense_1/kernel"], p[f"{scope}/Mlp/Dense_1/bias"]
  num_experts = w1.shape[0]
  router = p[f"{scope}/Router/dense/kernel"]
  router = router.reshape(d, members, num_experts // members)  # (D, M, E/M); M = 1: (D, 1, E)
  y = np.zeros_like(x)
  for r in range(rows):
    m = r % members
    gates = softmax(x[r] @ router[:, m, :])  # (T, E/M)
    order = np.argsort(-gates, axis=-1, kind="stable")  # ties: the lower expert first
    if trace is not None and gates.shape[-1] > k:
      top = np.take_along_axis(gates, order, axis=-1)
      margin = float((top[:, k - 1] - top[:, k]).min())
      trace["min_gate_margin"] = min(trace.get("min_gate_margin", np.inf), margin)
    for t in range(tokens):
      for choice in range(k):
        local = order[t, choice]
        e = m * (num_experts // members) + local
        h = gelu(x[r, t] @ w1[e] + b1[e])
        y[r, t] += gates[t, local] * (h @ w2[e] + b2[e])
  return y


def forward(params: dict, images: np.ndarray, *, layout: str, k: int = 2, ensemble_size: int = 1,
            router: str = "token_choice", group_size: int | None = None,
            capacity_factor: float = 1.0, capacity_ceil_or_round: str = "ceil",
            capacity_multiple_of: int | None = 4, bfloat16_dispatch: bool = False,
            dtype=np.float64, trace: dict | None = None) -> np.ndarray:
  """Logits of the reference model: (B, C), or (B*M, C) member logits of an E³ model (row b*M+m
  is member m on image b). `layout`: "vmoe", "big_vision" or "vision_transformer".

  MoE blocks with a dense router kernel route by `router`: "token_choice" (top-`k` experts per
  token, nothing dropped) or "experts_choice" (top-C tokens per expert, C from `compute_capacity`
  of the group's tokens with `capacity_factor`, `capacity_ceil_or_round`,
  `capacity_multiple_of`, the reference dispatcher's keys); blocks with `Moe/Router/mu` are Soft
  MoE. `bfloat16_dispatch`: the data dispatched to and combined from the experts rounded to
  bfloat16, as the reference's Soft MoE always does (and its experts-choice dispatcher with
  `bfloat16=True`); our float32 model mixes at full precision. Routing
  groups hold `group_size` tokens (the reference's `moe.group_size`; default: one image's).

  `trace`, if given, receives "min_gate_margin": the smallest gap between a token's k-th and
  (k+1)-th gate (token-choice) or an expert's C-th and (C+1)-th gate (experts-choice), where a
  tie would make the choice precision dependent; for experts-choice, per MoE layer, "capacity"
  and "fraction_processed_tokens" (tokens at least one expert took); for Soft MoE, "slots" per
  expert of each MoE layer."""
  if router not in ("token_choice", "experts_choice"):
    raise ValueError(f"router {router!r}: token_choice or experts_choice (soft is read from mu)")
  p = {name: np.asarray(v, dtype) for name, v in _unscan(_strip(params)).items()}
  x = np.asarray(images, dtype)
  encoder = "Encoder" if layout == "vmoe" else "Transformer"
  names = {  # (norm1, attention, norm2, dense mlp)
      "vmoe": ("LayerNorm_0", "SelfAttention", "LayerNorm_1", "Mlp"),
      "big_vision": ("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0"),
      "vision_transformer": ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2",
                             "MlpBlock_3"),
  }[layout]
  x = conv_patches(x, p["embedding/kernel"], p["embedding/bias"])
  b, _, d = x.shape
  cls = np.broadcast_to(p["cls"], (b, 1, d)) if "cls" in p else None
  if layout == "big_vision":
    x = x + p["pos_embedding"]
    if cls is not None:
      x = np.concatenate([cls, x], axis=1)
  else:
    if cls is not None:
      x = np.concatenate([cls, x], axis=1)
    x = x + p[f"{encoder}/posembed_input/pos_embedding"]

  num_layers = 1 + max(int(n.split("/")[1].split("_")[1]) for n in p
                       if n.startswith(f"{encoder}/encoderblock_"))
  tiled = False
  for i in range(num_layers):
    scope = f"{encoder}/encoderblock_{i}"
    is_soft = f"{scope}/Moe/Router/mu" in p
    is_moe = is_soft or f"{scope}/Moe/Router/dense/kernel" in p
    if is_moe and not tiled:
      x = np.repeat(x, ensemble_size, axis=0)
      tiled = True
    y = layer_norm(x, p, f"{scope}/{names[0]}")
    x = x + attention(y, y, p, f"{scope}/{names[1]}")
    y = layer_norm(x, p, f"{scope}/{names[2]}")
    if is_soft:
      x = x + soft_moe(y, p, f"{scope}/Moe", group_size=group_size,
                       bfloat16_dispatch=bfloat16_dispatch, trace=trace)
    elif is_moe and router == "experts_choice":
      x = x + experts_choice_moe(y, p, f"{scope}/Moe", group_size=group_size,
                                 capacity_factor=capacity_factor,
                                 ceil_or_round=capacity_ceil_or_round,
                                 multiple_of=capacity_multiple_of,
                                 bfloat16_dispatch=bfloat16_dispatch, trace=trace)
    elif is_moe:  # token-choice: no capacity, so each image may as well be its own group
      kernel = p[f"{scope}/Moe/Router/dense/kernel"]
      members = kernel.shape[1] if kernel.ndim == 3 else ensemble_size
      x = x + moe(y, p, f"{scope}/Moe", k=k, members=members, trace=trace)
    else:
      x = x + mlp(y, p, f"{scope}/{names[3]}")
  x = layer_norm(x, p, f"{encoder}/encoder_norm")

  map_scope = {"vmoe": "MapHead", "big_vision": "MAPHead_0"}.get(layout)
  if cls is not None:
    x = x[:, 0]
  elif map_scope and f"{map_scope}/probe" in p:
    att, ln, mlp_name = (("MultiHeadDotProductAttention", "LayerNorm", "Mlp") if layout == "vmoe"
                         else ("MultiHeadDotProductAttention_0", "LayerNorm_0", "MlpBlock_0"))
    probe = np.broadcast_to(p[f"{map_scope}/probe"], (x.shape[0], 1, d))
    y = attention(probe, x, p, f"{map_scope}/{att}")
    y = y + mlp(layer_norm(y, p, f"{map_scope}/{ln}"), p, f"{map_scope}/{mlp_name}")
    x = y[:, 0]
  else:
    x = x.mean(axis=1)
  if "pre_logits/kernel" in p:
    x = np.tanh(dense(x, p, "pre_logits"))
  return dense(x, p, "head")
