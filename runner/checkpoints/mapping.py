"""Released checkpoints' parameter names -> this project's (runner/models/vit.py).

Three layouts are understood (`detect_layout`; their scope names: `_SPECS`), flat "/"-joined
names, with or without a leading `params/` (the entries of a train state beside it — optimizer
state, step, rngs — are ignored):

* vmoe (google-research/vmoe: V-MoE, E³, ViT): blocks `Encoder/encoderblock_{i}/`, Mlp or Moe;
  pos_embedding (1, N+1, D) with a class token (added after it is concatenated).
* big_vision: blocks `Transformer/encoderblock_{i}/` (scanned: `Transformer/encoderblock/`, depth
  axis first); top-level pos_embedding (1, N, D), added before the class token (as ours is).
* vision_transformer (augreg): blocks `Transformer/encoderblock_{i}/`; pos_embedding (1, N+1, D)
  with a class token.

and map onto our names (`to_ours`):

  LayerNorm_0 / LayerNorm_1|2          block_{i}/norm1, block_{i}/norm2
  {query,key,value}/kernel (D, H, hd)  block_{i}/attention/qkv_kernel (D, 3, H, hd): q, k, v
  {query,key,value}/bias (H, hd)       block_{i}/attention/qkv_bias (3, H, hd)
  out/kernel (H, hd, D), out/bias      block_{i}/attention/out_kernel, out_bias
  Mlp|MlpBlock_*/Dense_0|Dense_1       block_{i}/mlp/fc1|fc2/{kernel,bias}
  Moe/Mlp/Dense_0 (E, D, F), bias      block_{i}/moe/experts/fc1_kernel, fc1_bias
  Moe/Mlp/Dense_1 (E, F, D), bias      block_{i}/moe/experts/fc2_kernel, fc2_bias
  Moe/Router/dense/kernel              block_{i}/moe/router/dense/kernel (D, E) (token- and
                                       experts-choice); E³'s (D, M, E/M) read as (D, E): `_moe`
  Moe/Router/mu (D, E, P), scale ()    block_{i}/moe/router/mu, scale (Soft MoE)
  {query,key}_ln/scale (hd,)           block_{i}/attention/{query,key}_ln/scale (qk-norm)
  encoder_norm                         encoder_norm
  embedding/kernel (p, p, c, D), bias  embedding_kernel, embedding_bias
  cls, posemb                          cls, pos_embedding (1, N, D): see `_fold_class_position`
  pre_logits, head                     pre_logits, head
  MapHead | MAPHead_0 (probe,          map_head/probe, map_head/attention/{query,key,value,out},
  attention, LayerNorm, Mlp|MlpBlock)  map_head/norm, map_head/mlp/fc1|fc2

Every array is checked against the dimensions the tree itself implies (hidden size from its
layer norms, heads from its attention, MLP width, experts); whatever is missing, mis-shaped or
left over (a layer our model does not have) is reported in one `CheckpointError`, by the
checkpoint's own names."""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Callable, Mapping

import numpy as np

from runner.errors import CheckpointError

# Top-level entries of a saved train state that are not parameters.
_TRAINING_STATE = frozenset({"opt", "opt_state", "optimizer", "optimizer_state", "step",
                             "global_step", "rngs", "rng", "metrics", "extra"})
_SHOWN = 6


@dataclasses.dataclass(frozen=True)
class _Layout:
  name: str
  encoder: str  # the scope of blocks and the encoder norm
  posemb: str  # the learned position embedding
  class_position: bool  # posemb has a first row for the class token (when there is one)
  norm1: str
  attention: str
  norm2: str
  mlp: str
  moe: str | None = None  # the sparse MoE MLP of a block (vmoe only)
  # The MAP head's scopes (vision_transformer has no MAP head: vmoe's names, unused).
  map_head: str = "MapHead"
  map_attention: str = "MultiHeadDotProductAttention"
  map_norm: str = "LayerNorm"
  map_mlp: str = "Mlp"


_SPECS = {
    "vmoe": _Layout("vmoe", "Encoder", "Encoder/posembed_input/pos_embedding", True,
                    "LayerNorm_0", "SelfAttention", "LayerNorm_1", "Mlp", "Moe"),
    "big_vision": _Layout("big_vision", "Transformer", "pos_embedding", False,
                          "LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1",
                          "MlpBlock_0", None, "MAPHead_0", "MultiHeadDotProductAttention_0",
                          "LayerNorm_0", "MlpBlock_0"),
    "vision_transformer": _Layout("vision_transformer", "Transformer",
                                  "Transformer/posembed_input/pos_embedding", True,
                                  "LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2",
                                  "MlpBlock_3"),
}
_UNDERSTOOD = ("google-research/vmoe V-MoE / E³ / ViT (Encoder/encoderblock_<i>/..., "
               "Encoder/posembed_input), big_vision ViT (Transformer/encoderblock[_<i>]/..., "
               "top-level pos_embedding), vision_transformer ViT (Transformer/encoderblock_<i>/"
               "MultiHeadDotProductAttention_1, Transformer/posembed_input); names may start with "
               "params/")


def _parameters(flat: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The parameters of a flat tree: under `params/` (or a flax optimizer's `optimizer/target/`)
  when there is such a prefix, else everything but the entries of a train state."""
  for prefix in ("params/", "optimizer/target/", "target/"):
    if any(name.startswith(prefix) for name in flat):
      return {name[len(prefix):]: flat[name] for name in flat if name.startswith(prefix)}
  return {name: flat[name] for name in flat if name.split("/", 1)[0] not in _TRAINING_STATE}


def _layout_of(params: Mapping[str, np.ndarray]) -> str:
  roots = {name.split("/", 1)[0] for name in params}
  if "Encoder" in roots:
    return "vmoe"
  if "Transformer" in roots:
    augreg = ("Transformer/posembed_input/", "/MultiHeadDotProductAttention_1/", "/MlpBlock_3/")
    if any(marker in f"{name}/" for name in params for marker in augreg):
      return "vision_transformer"
    return "big_vision"
  shown = sorted(roots)[:_SHOWN]
  more = f" and {len(roots) - len(shown)} more" if len(roots) > len(shown) else ""
  raise CheckpointError(
      f"the checkpoint's parameters are in no layout understood (top-level names: "
      f"{', '.join(shown) or 'none'}{more}). Understood: {_UNDERSTOOD}.")


def detect_layout(flat: Mapping[str, np.ndarray]) -> str:
  """"vmoe", "big_vision" or "vision_transformer"; CheckpointError for anything else."""
  return _layout_of(_parameters(flat))


def _unscan(params: dict[str, np.ndarray], problems: list[str]) -> dict[str, np.ndarray]:
  """A scanned big_vision encoder (`Transformer/encoderblock/...`) as numbered blocks (views)."""
  scope = "Transformer/encoderblock/"
  scanned = [name for name in params if name.startswith(scope)]
  if not scanned:
    return params
  depths = collections.Counter(np.shape(params[name])[0] if np.ndim(params[name]) else 0
                               for name in scanned)
  depth = depths.most_common(1)[0][0]
  out = {name: value for name, value in params.items() if not name.startswith(scope)}
  for name in scanned:
    value = params[name]
    if np.ndim(value) == 0 or np.shape(value)[0] != depth:
      problems.append(f"{name}: shape {np.shape(value)}, expected a leading depth axis of "
                      f"{depth} like the other scanned block parameters")
      continue
    rest = name[len(scope):]
    value = np.asarray(value)
    for i in range(depth):
      out[f"Transformer/encoderblock_{i}/{rest}"] = value[i]
  return out


def _mode(values) -> int | tuple | None:
  counts = collections.Counter(values)
  return counts.most_common(1)[0][0] if counts else None


@dataclasses.dataclass
class _Dims:
  """What the tree's own arrays say the model's dimensions are (the most common value wins, so
  one mis-shaped array is reported rather than taken as the truth)."""
  hidden: int | None
  heads: int | None
  head_dim: int | None
  mlp: int | None
  experts: int | None
  blocks: tuple[int, ...]


def _dims(params, layout: _Layout) -> _Dims:
  shapes = {name: np.shape(value) for name, value in params.items()}
  hidden = _mode(s[0] for n, s in shapes.items()
                 if n.endswith("/scale") and not n.endswith("_ln/scale") and len(s) == 1)
  if hidden is None and len(shapes.get("embedding/kernel", ())) == 4:
    hidden = shapes["embedding/kernel"][-1]
  qh = _mode(s[1:] for n, s in shapes.items() if n.endswith("/query/kernel") and len(s) == 3)
  block = re.compile(rf"^{layout.encoder}/encoderblock_(\d+)/")
  blocks = tuple(sorted({int(m[1]) for name in params if (m := block.match(name))}))
  mlp = _mode([s[-1] for n, s in shapes.items()
               if re.search(rf"/encoderblock_\d+/{layout.mlp}/Dense_0/kernel$", n) and len(s) == 2]
              + [s[-1] for n, s in shapes.items()
                 if n.endswith("/Moe/Mlp/Dense_0/kernel") and len(s) == 3])
  experts = _mode(s[0] for n, s in shapes.items()
                  if n.endswith("/Moe/Mlp/Dense_0/kernel") and len(s) == 3)
  return _Dims(hidden, qh[0] if qh else None, qh[1] if qh else None, mlp, experts, blocks)


def _fmt(shape) -> str:
  inner = ", ".join("?" if d is None else str(d) for d in shape)
  return f"({inner},)" if len(shape) == 1 else f"({inner})"


class Reader:
  """Takes named arrays out of the tree, checking shapes; what it never takes is unmapped (timm's
  and transformers' state_dicts are read by its subclass, pytorch_vit.Reader)."""

  def __init__(self, params: dict[str, np.ndarray], problems: list[str]):
    self.params, self.problems, self.remaining = params, problems, set(params)

  def has(self, prefix: str) -> bool:
    return any(name.startswith(prefix) for name in self.params)

  def take(self, name: str, shape: tuple | None, *, optional: bool = False,
           check: Callable[[tuple], str | None] | None = None) -> np.ndarray | None:
    """The array `name` if its shape fits `shape` (None: any size along that axis) and `check`
    (which returns what is wrong, or None); else None, with the problem recorded."""
    if name not in self.params:
      if not optional:
        self.problems.append(f"{name}: missing")
      return None
    self.remaining.discard(name)
    value = self.params[name]
    actual = tuple(np.shape(value))
    if shape is not None and (len(actual) != len(shape) or any(
        e is not None and a != e for a, e in zip(actual, shape))):
      self.problems.append(f"{name}: shape {actual}, expected {_fmt(shape)}")
      return None
    if check is not None and (wrong := check(actual)):
      self.problems.append(f"{name}: shape {actual}, {wrong}")
      return None
    return np.asarray(value)


def _fold_class_position(cls: np.ndarray, posemb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(ours cls, ours pos_embedding) from a reference posemb with a class row (1, N+1, D). We add
  position embeddings to the patch tokens only, then prepend `cls`; the reference's class token
  input, cls + posemb[:, 0], is a constant: as our `cls` it gives the same input, bit for bit."""
  return cls + posemb[:, :1], posemb[:, 1:]  # the second is a view


def _attention(reader: Reader, scope: str, dims: _Dims, out: dict, ours: str, *, fused: bool):
  """query/key/value/out of a flax MultiHeadDotProductAttention at `scope`."""
  d, h, hd = dims.hidden, dims.heads, dims.head_dim
  heads_fit = (lambda s: None if h is None or h * hd == d else
               f"heads x head size {h} x {hd} != hidden size {d}")
  kernels = [reader.take(f"{scope}/{p}/kernel", (d, h, hd), check=heads_fit)
             for p in ("query", "key", "value")]
  biases = [reader.take(f"{scope}/{p}/bias", (h, hd)) for p in ("query", "key", "value")]
  out_kernel = reader.take(f"{scope}/out/kernel", (h, hd, d))
  out_bias = reader.take(f"{scope}/out/bias", (d,))
  for norm in ("query_ln", "key_ln"):  # flax's normalize_qk: a scale per head dimension
    if reader.has(f"{scope}/{norm}/"):
      out[f"{ours}/{norm}/scale"] = reader.take(f"{scope}/{norm}/scale", (hd,))
  if fused:  # our SelfAttention: q, k, v at index 0, 1, 2 of axis 1 (kernel) / axis 0 (bias)
    if all(k is not None for k in kernels):
      out[f"{ours}/qkv_kernel"] = np.stack(kernels, axis=1)
    if all(b is not None for b in biases):
      out[f"{ours}/qkv_bias"] = np.stack(biases, axis=0)
    out[f"{ours}/out_kernel"], out[f"{ours}/out_bias"] = out_kernel, out_bias
  else:  # flax's own module (our MAP head): the same names
    for p, k, b in zip(("query", "key", "value"), kernels, biases):
      out[f"{ours}/{p}/kernel"], out[f"{ours}/{p}/bias"] = k, b
    out[f"{ours}/out/kernel"], out[f"{ours}/out/bias"] = out_kernel, out_bias


def _norm(reader: Reader, scope: str, d: int | None, out: dict, ours: str):
  out[f"{ours}/scale"] = reader.take(f"{scope}/scale", (d,))
  out[f"{ours}/bias"] = reader.take(f"{scope}/bias", (d,))


def _mlp(reader: Reader, scope: str, dims: _Dims, out: dict, ours: str):
  d, f = dims.hidden, dims.mlp
  out[f"{ours}/fc1/kernel"] = reader.take(f"{scope}/Dense_0/kernel", (d, f))
  out[f"{ours}/fc1/bias"] = reader.take(f"{scope}/Dense_0/bias", (f,))
  out[f"{ours}/fc2/kernel"] = reader.take(f"{scope}/Dense_1/kernel", (f, d))
  out[f"{ours}/fc2/bias"] = reader.take(f"{scope}/Dense_1/bias", (d,))


def _moe(reader: Reader, scope: str, dims: _Dims, out: dict, ours: str, ensemble_size: int):
  d, f, e = dims.hidden, dims.mlp, dims.experts
  mlp = f"{scope}/Mlp"
  out[f"{ours}/experts/fc1_kernel"] = reader.take(f"{mlp}/Dense_0/kernel", (e, d, f))
  out[f"{ours}/experts/fc1_bias"] = reader.take(f"{mlp}/Dense_0/bias", (e, f))
  out[f"{ours}/experts/fc2_kernel"] = reader.take(f"{mlp}/Dense_1/kernel", (e, f, d))
  out[f"{ours}/experts/fc2_bias"] = reader.take(f"{mlp}/Dense_1/bias", (e, d))

  def router_fits(shape):
    if len(shape) == 2:
      if shape != (d, e):
        return f"expected {_fmt((d, e))} (hidden size, experts)"
      if ensemble_size > 1 and e % ensemble_size:
        return (f"{e} experts cannot be split among ensemble_size={ensemble_size} members")
      return None
    if len(shape) == 3:
      if shape[0] != d or shape[1] * shape[2] != e:
        return f"expected (D, M, E/M) with D={d} and M x E/M = {e} experts"
      if ensemble_size > 1 and shape[1] != ensemble_size:
        return (f"a partitioned ensemble router of M={shape[1]} members, but the model has "
                f"ensemble_size={ensemble_size}")
      return None
    return f"expected {_fmt((d, e))} or (D, M, E/M)"

  if reader.has(f"{scope}/Router/mu"):  # Soft MoE: slot parameters and a scale, no kernel
    out[f"{ours}/router/mu"] = reader.take(f"{scope}/Router/mu", (d, e, None))
    out[f"{ours}/router/scale"] = reader.take(f"{scope}/Router/scale", ())
    return
  kernel = reader.take(f"{scope}/Router/dense/kernel", None, check=router_fits)
  # (D, M, E/M) -> (D, E): a row-major reshape (column m*E/M + j is member m's expert j, the
  # layout of our router and of the reference's vmapped one), never a transpose. A view.
  out[f"{ours}/router/dense/kernel"] = None if kernel is None else kernel.reshape(d, e)


def to_ours(flat: Mapping[str, np.ndarray], *, ensemble_size: int = 1) -> dict[str, np.ndarray]:
  """Our flat parameter names (runner.models.transfer.flatten's) for a released checkpoint's.
  `ensemble_size` > 1: a partitioned batch ensemble of that many members, the M of a router stored
  (D, M, E/M). Arrays are views of the input where possible (not the fused q/k/v, folded cls)."""
  params = _parameters(flat)
  layout = _SPECS[_layout_of(params)]
  problems: list[str] = []
  if layout.name == "big_vision":
    params = _unscan(params, problems)
  dims = _dims(params, layout)
  d, blocks = dims.hidden, dims.blocks
  reader = Reader(params, problems)
  out: dict[str, np.ndarray | None] = {}
  if not blocks:
    problems.append(f"{layout.encoder}/encoderblock_0: missing (no encoder blocks)")
  for i in range(max(blocks) + 1 if blocks else 0):
    scope = f"{layout.encoder}/encoderblock_{i}"
    if i not in blocks:
      problems.append(f"{scope}: missing (the blocks {blocks[0]}..{blocks[-1]} have gaps)")
      continue
    _norm(reader, f"{scope}/{layout.norm1}", d, out, f"block_{i}/norm1")
    _attention(reader, f"{scope}/{layout.attention}", dims, out, f"block_{i}/attention", fused=True)
    _norm(reader, f"{scope}/{layout.norm2}", d, out, f"block_{i}/norm2")
    if layout.moe and reader.has(f"{scope}/{layout.moe}/"):
      _moe(reader, f"{scope}/{layout.moe}", dims, out, f"block_{i}/moe", ensemble_size)
    else:
      _mlp(reader, f"{scope}/{layout.mlp}", dims, out, f"block_{i}/mlp")
  _norm(reader, f"{layout.encoder}/encoder_norm", d, out, "encoder_norm")

  square = lambda s: None if s[0] == s[1] else "expected square patches (p, p, channels, D)"
  out["embedding_kernel"] = reader.take("embedding/kernel", (None, None, None, d), check=square)
  out["embedding_bias"] = reader.take("embedding/bias", (d,))
  cls = reader.take("cls", (1, 1, d), optional=True)
  with_class_row = cls is not None and layout.class_position
  posemb = reader.take(layout.posemb, (1, None, d), check=lambda s: (
      "expected a class row and at least one patch row" if with_class_row and s[1] < 2 else None))
  if with_class_row and posemb is not None:
    out["cls"], out["pos_embedding"] = _fold_class_position(cls, posemb)
  else:  # big_vision adds posemb before the class token is concatenated, as we do
    if cls is not None:
      out["cls"] = cls
    out["pos_embedding"] = posemb

  if reader.has(f"{layout.map_head}/"):
    m = layout.map_head
    out["map_head/probe"] = reader.take(f"{m}/probe", (1, 1, d))
    _attention(reader, f"{m}/{layout.map_attention}", dims, out, "map_head/attention", fused=False)
    _norm(reader, f"{m}/{layout.map_norm}", d, out, "map_head/norm")
    _mlp(reader, f"{m}/{layout.map_mlp}", dims, out, "map_head/mlp")

  width = d
  if reader.has("pre_logits/"):
    kernel = reader.take("pre_logits/kernel", (d, None))
    width = None if kernel is None else kernel.shape[1]
    out["pre_logits/kernel"] = kernel
    out["pre_logits/bias"] = reader.take("pre_logits/bias", (width,))
  if reader.has("head/"):  # a checkpoint without a head is a feature extractor
    kernel = reader.take("head/kernel", (width, None))
    out["head/kernel"] = kernel
    out["head/bias"] = reader.take("head/bias", (None if kernel is None else kernel.shape[1],))

  problems += [f"{name}: not mapped (our model has no such parameter)"
               for name in sorted(reader.remaining)]
  if problems:
    shown = "; ".join(problems[:_SHOWN])
    more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    raise CheckpointError(
        f"the {layout.name} checkpoint's parameters do not map onto this project's ViT/V-MoE "
        f"({len(problems)} problem(s)): {shown}{more}.")
  return out  # every value is set: a None would have been reported above


def model_hint(flat: Mapping[str, np.ndarray]) -> dict:
  """What the parameters say about the model (None where they do not say), e.g. to tell a user
  which `model=` fits a released checkpoint; {} when the layout is not understood. The number
  of selected experts k and the routing group size are not stored in parameters."""
  params = _parameters(flat)
  try:
    layout = _SPECS[_layout_of(params)]
  except CheckpointError:
    return {}
  if layout.name == "big_vision":
    params = _unscan(params, [])
  dims = _dims(params, layout)
  shape = lambda name: tuple(np.shape(params[name])) if name in params else None
  router = f"{layout.encoder}/encoderblock_{{}}/Moe/Router/dense/kernel"
  slots = f"{layout.encoder}/encoderblock_{{}}/Moe/Router/mu"
  moe_layers = tuple(i for i in dims.blocks if layout.moe and (
      router.format(i) in params or slots.format(i) in params))
  routers = [shape(router.format(i)) for i in moe_layers if router.format(i) in params]
  members = _mode(s[1] for s in routers if len(s) == 3)
  soft = [shape(slots.format(i)) for i in moe_layers if slots.format(i) in params]
  kernel, posemb = shape("embedding/kernel"), shape(layout.posemb)
  patch = kernel[0] if kernel and len(kernel) == 4 else None
  tokens = (posemb[1] - (1 if "cls" in params and layout.class_position else 0)
            if posemb and len(posemb) == 3 else None)
  side = math.isqrt(tokens) if tokens else None
  head, rep = shape("head/kernel"), shape("pre_logits/kernel")
  classifier = ("token" if "cls" in params else
                "map" if any(n.startswith(f"{layout.map_head}/") for n in params) else "gap")
  return {
      "layout": layout.name,
      "hidden_size": dims.hidden,
      "num_layers": len(dims.blocks) or None,
      "mlp_dim": dims.mlp,
      "num_heads": dims.heads,
      "patch_size": patch,
      "image_size": side * patch if side and patch and side * side == tokens else None,
      "classifier": classifier,
      "representation_size": rep[-1] if rep else None,
      "num_classes": head[-1] if head else None,
      "moe_layers": moe_layers or None,
      "num_experts": dims.experts if moe_layers else None,
      "ensemble_size": members,
      "router": ("soft" if soft else "token_choice or experts_choice") if moe_layers else None,
      "slots_per_expert": _mode(s[2] for s in soft if len(s) == 3),
  }
