"""The reference models' forward pass in NumPy, on their own parameter names, for parity tests.

Written from the reference code, not from this project's: google-research/vmoe
(vmoe/nn/vit_moe.py, vit_moe_ensemble.py, ensemble_routing.py, routing.py, moe.py),
vision_transformer (vit_jax/models_vit.py) and big_vision (big_vision/models/vit.py), with flax's
nn.Conv, nn.LayerNorm, nn.MultiHeadDotProductAttention and nn.gelu. Inference only: no dropout,
no router noise (their routers are deterministic at evaluation), and MoE capacities large enough
that no token is dropped, so that every token reaches its top-k experts:

* patch embedding: a VALID convolution with stride = kernel size (p, p);
* vmoe / vision_transformer: class token concatenated first, then `posembed_input` (N+1 rows)
  added to every token; big_vision: `pos_embedding` (N rows) added to the patches, then the class
  token concatenated (it gets no position);
* pre-LN encoder blocks: x + Attention(LN(x)), then x + MLP(LN(x)); LayerNorm epsilon 1e-6
  (flax's default), biased variance;
* attention: per-head q, k, v of kernels (D, H, hd), q scaled by hd**-0.5, softmax over keys,
  output kernel (H, hd, D);
* MLP: Dense_0, GELU (flax nn.gelu's default, the tanh approximation), Dense_1;
* MoE (vmoe): router logits x @ W (no bias), softmax over the E experts, the top-k experts by
  gate, their outputs summed weighted by the gates themselves (not renormalised; the dispatcher
  uses the gates as combine weights);
* E³ (vit_moe_ensemble): before the first MoE block the batch is repeated M times with
  np.repeat (row b*M + m is member m's copy of image b); member m's tokens are routed by the
  m-th slice of the router kernel (D, M, E/M), softmax over its E/M experts only, among the
  experts m*E/M .. (m+1)*E/M - 1; the model returns the (B*M, C) member logits;
* encoder norm, pooling (class token, mean of tokens, or MAP head), optional pre_logits + tanh,
  head.
"""
from __future__ import annotations

import math

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


def attention(q_in, kv_in, p: dict, scope: str):
  """flax MultiHeadDotProductAttention: (B, Tq, D), (B, Tk, D) -> (B, Tq, D)."""
  def project(x, name):  # (B, T, D) x (D, H, hd) -> (B, T, H, hd)
    return np.einsum("btd,dhk->bthk", x, p[f"{scope}/{name}/kernel"]) + p[f"{scope}/{name}/bias"]
  q, k, v = project(q_in, "query"), project(kv_in, "key"), project(kv_in, "value")
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
            dtype=np.float64, trace: dict | None = None) -> np.ndarray:
  """Logits of the reference model: (B, C), or (B*M, C) member logits of an E³ model (row b*M+m
  is member m on image b). `layout`: "vmoe", "big_vision" or "vision_transformer". `trace`, if
  given, receives "min_gate_margin": the smallest gap between a token's k-th and (k+1)-th gate
  (a tie there would make the choice of experts precision dependent)."""
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
    is_moe = f"{scope}/Moe/Router/dense/kernel" in p
    if is_moe and not tiled:
      x = np.repeat(x, ensemble_size, axis=0)
      tiled = True
    y = layer_norm(x, p, f"{scope}/{names[0]}")
    x = x + attention(y, y, p, f"{scope}/{names[1]}")
    y = layer_norm(x, p, f"{scope}/{names[2]}")
    if is_moe:
      router = p[f"{scope}/Moe/Router/dense/kernel"]
      members = router.shape[1] if router.ndim == 3 else ensemble_size
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
