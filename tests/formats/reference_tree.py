"""Random parameter trees under the reference code's names (google-research/vmoe V-MoE, E³,
experts-choice and Soft MoE, big_vision and vision_transformer ViTs), shaped as the reference code
creates them: what a released checkpoint holds, for tests that map, write and load them.

* The experts-choice router of the reference (`NoisyTopItemsPerExpertRouter`) has the very
  parameters of the token-choice one (`Moe/Router/dense/kernel`, (D, E)): its trees are the
  V-MoE trees.
* A Soft MoE router (vmoe/projects/soft_moe/router.py `SoftRouter`, `router="soft"`) holds
  `Moe/Router/mu` (D, E, P) and the scalar `Moe/Router/scale` instead of the dense kernel.
* `qk_norm`: flax's `MultiHeadDotProductAttention(normalize_qk=True)` (the Soft MoE paper's
  ViTs, vmoe's `attention_qk_norm`) adds `query_ln/scale` and `key_ln/scale`, (head_dim,), to every
  attention; vmoe's `MapHead` gets them too (its `qk_norm` is the encoder's
  `attention_qk_norm`).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Dims:
  hidden: int = 32
  layers: int = 4
  mlp: int = 64
  heads: int = 2
  patch: int = 4
  image: int = 16
  classes: int = 10

  @property
  def tokens(self) -> int:
    return (self.image // self.patch) ** 2


SUBLAYERS = {  # (blocks scope, norm1, attention, norm2, dense mlp)
    "vmoe": ("Encoder", "LayerNorm_0", "SelfAttention", "LayerNorm_1", "Mlp"),
    "big_vision": ("Transformer", "LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1",
                   "MlpBlock_0"),
    "vision_transformer": ("Transformer", "LayerNorm_0", "MultiHeadDotProductAttention_1",
                           "LayerNorm_2", "MlpBlock_3"),
}


class _Random:
  def __init__(self, seed):
    self.rng = np.random.default_rng(seed)

  def __call__(self, shape, std, mean=0.0):
    return (mean + std * self.rng.standard_normal(shape)).astype(np.float32)


def _norm(r, out, scope, d):
  D = d.hidden
  out[f"{scope}/scale"], out[f"{scope}/bias"] = r((D,), 0.1, 1.0), r((D,), 0.1)


def _attention(r, out, scope, d, qk_norm=False):
  D, HEADS = d.hidden, d.heads
  for p in ("query", "key", "value"):
    out[f"{scope}/{p}/kernel"] = r((D, HEADS, D // HEADS), 0.15)
    out[f"{scope}/{p}/bias"] = r((HEADS, D // HEADS), 0.05)
  out[f"{scope}/out/kernel"] = r((HEADS, D // HEADS, D), 0.1)
  out[f"{scope}/out/bias"] = r((D,), 0.05)
  if qk_norm:  # flax's LayerNorm(use_bias=False) over each head's dimensions
    out[f"{scope}/query_ln/scale"] = r((D // HEADS,), 0.3, 1.0)
    out[f"{scope}/key_ln/scale"] = r((D // HEADS,), 0.3, 1.0)


def _mlp(r, out, scope, d):
  D, MLP = d.hidden, d.mlp
  out[f"{scope}/Dense_0/kernel"], out[f"{scope}/Dense_0/bias"] = r((D, MLP), 0.15), r((MLP,), 0.05)
  out[f"{scope}/Dense_1/kernel"], out[f"{scope}/Dense_1/bias"] = r((MLP, D), 0.1), r((D,), 0.05)


def reference_tree(layout, *, seed=0, moe_layers=(), experts=4, members=1, router="stacked",
                   slots=1, qk_norm=False, classifier="token", representation=None, scanned=False,
                   dims: Dims = Dims()):
  """Reference-named random parameters, shaped as the reference code creates them.

  `router`: "stacked" (the dense kernel as the reference stores it, (D, M, E/M) for an E³ model
  of M = `members`, (D, 1, E) otherwise), "flat" (the same kernel as (D, E)), or "soft" (Soft MoE:
  `mu` (D, E, `slots`) and `scale` ()). `qk_norm`: query/key layer norms in every attention."""
  d = dims
  D, LAYERS, MLP, PATCH, TOKENS, CLASSES = d.hidden, d.layers, d.mlp, d.patch, d.tokens, d.classes
  r = _Random(seed)
  enc, n1, att, n2, mlp = SUBLAYERS[layout]
  out = {}
  blocks = []
  for i in range(LAYERS):
    block = {}
    _norm(r, block, n1, d)
    _attention(r, block, att, d, qk_norm)
    _norm(r, block, n2, d)
    if i in moe_layers:  # vmoe's vmapped experts (leading E axis) and router
      block["Moe/Mlp/Dense_0/kernel"] = r((experts, D, MLP), 0.15)
      block["Moe/Mlp/Dense_0/bias"] = r((experts, MLP), 0.05)
      block["Moe/Mlp/Dense_1/kernel"] = r((experts, MLP, D), 0.1)
      block["Moe/Mlp/Dense_1/bias"] = r((experts, D), 0.05)
      if router == "soft":  # SoftRouter: mu is normalised over D, so its scale does not matter
        block["Moe/Router/mu"] = r((D, experts, slots), 1.0)
        block["Moe/Router/scale"] = np.asarray(r((), 1.0, 4.0))  # logits in [-scale, scale]
      else:
        kernel = r((D, members, experts // members), 0.3)  # E³: nn.vmap over members, axis 1
        if router == "flat":  # as a converted checkpoint might hold it
          kernel = kernel.reshape(D, experts)
        block["Moe/Router/dense/kernel"] = kernel
    else:
      _mlp(r, block, mlp, d)
    blocks.append(block)
  if scanned:
    out.update({f"{enc}/encoderblock/{n}": np.stack([b[n] for b in blocks]) for n in blocks[0]})
  else:
    out.update({f"{enc}/encoderblock_{i}/{n}": v
                for i, b in enumerate(blocks) for n, v in b.items()})
  _norm(r, out, f"{enc}/encoder_norm", d)
  out["embedding/kernel"], out["embedding/bias"] = r((PATCH, PATCH, 3, D), 0.1), r((D,), 0.05)
  token = classifier == "token"
  if token:
    out["cls"] = r((1, 1, D), 0.3)
  if layout == "big_vision":
    out["pos_embedding"] = r((1, TOKENS, D), 0.3)
  else:
    out[f"{enc}/posembed_input/pos_embedding"] = r((1, TOKENS + token, D), 0.3)
  if classifier == "map":
    if layout == "vmoe":
      scope, att, ln, m = "MapHead", "MultiHeadDotProductAttention", "LayerNorm", "Mlp"
    else:
      scope, att, ln, m = "MAPHead_0", "MultiHeadDotProductAttention_0", "LayerNorm_0", "MlpBlock_0"
    out[f"{scope}/probe"] = r((1, 1, D), 0.5)
    # vmoe's MapHead normalises q and k as its encoder does; big_vision's MAPHead never does.
    _attention(r, out, f"{scope}/{att}", d, qk_norm and layout == "vmoe")
    _norm(r, out, f"{scope}/{ln}", d)
    _mlp(r, out, f"{scope}/{m}", d)
  width = D
  if representation:
    out["pre_logits/kernel"] = r((D, representation), 0.3)
    out["pre_logits/bias"] = r((representation,), 0.1)
    width = representation
  out["head/kernel"], out["head/bias"] = r((width, CLASSES), 0.3), r((CLASSES,), 0.1)
  return out


