"""What timm's and transformers' ViTs share on their way into vmoe's (runner/models/vit.py).

Their weights are PyTorch tensors under dotted names: an `nn.Linear` weight is (out, in), the
patch embedding an `nn.Conv2d` weight (D, C, p, p). Ours are Flax kernels (in, out) under "/"
names, attention kernels split by head. `Reader` takes tensors by name and checks their shapes,
remembering what it never took (a layer vmoe's ViT does not have); `Architecture` is what the
files say the model is, as model.* keys, so that a command can be told the keys to give and be
refused when it gives others (runner/config/relations.py). Every problem found goes into one
CheckpointError naming the format found (`finish`)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from runner.checkpoints import mapping
from runner.errors import CheckpointError
from runner.models import catalog

_SHOWN = 6
# The model.* keys an Architecture may state, in the order they are shown.
KEYS = ("image_size", "patch_size", "hidden_size", "num_layers", "mlp_dim", "num_heads",
        "classifier", "representation_size", "activation", "layer_norm_eps", "registers",
        "layer_scale", "pre_norm", "fc_norm")


def shown(value) -> str:
  """A value as one types it in an override."""
  if isinstance(value, bool):
    return str(value).lower()
  return "null" if value is None else str(value)


@dataclasses.dataclass
class Architecture:
  """What a checkpoint's files say its ViT is: `stated` model.* keys (layer_scale: whether the
  blocks have it; its initial value is not part of the model), `unstated` the keys they cannot
  say (a bare state_dict stores no activation), the head's classes (None: no head)."""
  kind: str  # "timm ViT", "transformers ViT"
  name: str  # the architecture or class the files name, or what the tensors look like
  stated: dict
  unstated: tuple[str, ...] = ()
  num_classes: int | None = None
  layer_scale_init: float | None = None  # the value the files give, to suggest
  notes: tuple[str, ...] = ()  # what the files leave to vmoe's reading, said with the keys

  def overrides(self) -> list[str]:
    """`model=<the nearest catalog ViT>` and the model.* keys that make it this one."""
    patch = self.stated.get("patch_size") or 16
    best = None
    for size in catalog.SIZES:
      name = "vit_tiny" if size == "tiny" else f"vit_{size}{patch}"
      base = catalog.model_config(name)
      keys = [self.override(k) for k in KEYS
              if k in self.stated and not self.fits(k, getattr(base, k))]
      if best is None or len(keys) + 1 < len(best):
        best = [f"model={name}", *keys]
    return best

  def override(self, key: str) -> str:
    """`model.<key>=<what the files say>` (layer scale: its initial value, any when loaded)."""
    value = self.stated[key]
    if key == "layer_scale":
      value = (self.layer_scale_init or 1e-5) if value else None
    return f"model.{key}={shown(value)}"

  def fits(self, key: str, value) -> bool:
    """Whether a model's `key` is what the files say (activation null: gelu_tanh; layer scale:
    present or not)."""
    want = self.stated[key]
    if key == "layer_scale":
      return want == (value is not None)
    if key == "activation":
      return want == str(value or "gelu_tanh")
    if key == "layer_norm_eps":
      return math.isclose(float(value), want, rel_tol=1e-6)
    return want == (str(value) if isinstance(want, str) and value is not None else value)

  def describe(self) -> str:
    """'a timm ViT (vit_base_patch16_224: model=vit_b16 model.activation=gelu; ...)'."""
    parts = [" ".join(self.overrides())]
    if self.unstated:
      parts.append(f"its files do not say {', '.join(f'model.{k}' for k in self.unstated)}")
    parts += list(self.notes)
    parts.append(f"a head of {self.num_classes} classes" if self.num_classes
                 else "no classifier head")
    return f"a {self.kind} ({self.name}: {'; '.join(parts)})"


class Reader(mapping.Reader):
  """mapping's Reader over a state_dict: `has` a tensor by its exact name, tensors taken as
  float32 (a bfloat16 file's too)."""

  def has(self, name: str) -> bool:
    return name in self.params

  def has_prefix(self, prefix: str) -> bool:
    return super().has(prefix)

  def shape(self, name: str) -> tuple | None:
    return tuple(np.shape(self.params[name])) if name in self.params else None

  def drop(self, name: str) -> None:
    """A tensor read and deliberately left out (a masked-image-modelling mask token)."""
    self.remaining.discard(name)

  def take(self, name: str, shape: tuple | None, *, optional: bool = False) -> np.ndarray | None:
    """The tensor `name` as float32 if its shape is `shape` (None: any size on that axis); None
    when missing (a problem unless `optional`) or mis-shaped (a problem)."""
    value = super().take(name, shape, optional=optional)
    return None if value is None else np.asarray(value, np.float32)

  def unmapped(self) -> None:
    self.problems += [f"{name}: not mapped (vmoe's ViT has no such parameter)"
                      for name in sorted(self.remaining)]


def count(tensors: Mapping, prefix: str) -> int:
  """How many numbered layers `<prefix><i>.` the names hold (0, 1, ..., n-1 expected)."""
  found = {int(rest.split(".", 1)[0]) for name in tensors if name.startswith(prefix)
           and (rest := name[len(prefix):]).split(".", 1)[0].isdigit()}
  return max(found) + 1 if found else 0


def linear(reader: Reader, name: str, d_in: int | None, d_out: int | None, out: dict,
           ours: str) -> None:
  """An nn.Linear at `name` as our Dense `ours` (kernel = weight.T); a Linear without a bias
  (bias=False) gets a zero bias: the same function."""
  weight, bias = weight_and_bias(reader, name, d_in, d_out)
  out[f"{ours}/kernel"] = None if weight is None else weight.T
  out[f"{ours}/bias"] = (bias if bias is not None or weight is None
                         else np.zeros(weight.shape[0], np.float32))


def weight_and_bias(reader: Reader, name: str, d_in: int | None,
                    d_out: int | None) -> tuple[np.ndarray | None, np.ndarray | None]:
  """An nn.Linear's (weight, bias), its bias None when it has none (bias=False)."""
  return (reader.take(f"{name}.weight", (d_out, d_in)),
          reader.take(f"{name}.bias", (d_out,), optional=True))


def norm(reader: Reader, name: str, d: int | None, out: dict, ours: str) -> None:
  """An nn.LayerNorm (weight, bias) as ours (scale, bias)."""
  out[f"{ours}/scale"] = reader.take(f"{name}.weight", (d,))
  out[f"{ours}/bias"] = reader.take(f"{name}.bias", (d,))


def _stack(arrays: list[np.ndarray], axis: int) -> np.ndarray:
  """np.stack, or for the shape-only arrays a checkpoint is opened with (state_dicts.read with
  data=False: every stride 0), a shape-only result: a check allocates no model-sized array."""
  if all(a.ndim and not any(a.strides) for a in arrays):
    shape = list(arrays[0].shape)
    shape.insert(axis, len(arrays))
    return np.broadcast_to(np.zeros((), np.float32), tuple(shape))
  return np.stack(arrays, axis=axis)


def attention(q: tuple, k: tuple, v: tuple, o: tuple, heads: int, out: dict, ours: str, *,
              fused: bool = True) -> None:
  """Self-attention from (weight, bias) pairs of query, key, value and output projections (a bias
  may be None: zeros, as in a bias-free QKV) into our fused SelfAttention: qkv_kernel (D, 3, H, hd)
  whose output features run (q|k|v, head, head dim) as PyTorch's reshape reads them, qkv_bias
  (3, H, hd), out_kernel (H, hd, D), out_bias; not `fused`, into flax's MultiHeadDotProductAttention
  (our MAP head's): query/key/value kernels (D, H, hd), biases (H, hd), out kernel, bias."""
  if any(w is None for w, _ in (q, k, v, o)):
    return
  d = q[0].shape[1]
  hd = d // heads
  kernels = [w.T.reshape(d, heads, hd) for w, _ in (q, k, v)]
  biases = [np.zeros((heads, hd), np.float32) if b is None else b.reshape(heads, hd)
            for _, b in (q, k, v)]
  if fused:
    out[f"{ours}/qkv_kernel"] = _stack(kernels, axis=1)
    out[f"{ours}/qkv_bias"] = _stack(biases, axis=0)
  else:
    for part, kernel, bias in zip(("query", "key", "value"), kernels, biases):
      out[f"{ours}/{part}/kernel"], out[f"{ours}/{part}/bias"] = kernel, bias
  kernel, bias = ("out_kernel", "out_bias") if fused else ("out/kernel", "out/bias")
  out[f"{ours}/{kernel}"] = o[0].T.reshape(heads, hd, d)
  out[f"{ours}/{bias}"] = np.zeros(d, np.float32) if o[1] is None else o[1]


def patch_embedding(reader: Reader, name: str, d: int | None, out: dict) -> int | None:
  """An nn.Conv2d patch embedding (D, C, p, p) as our (p, p, C, D) kernel; the patch size. A
  convolution without a bias (CLIP's) gets a zero bias."""
  weight = reader.take(f"{name}.weight", (d, None, None, None))
  if weight is None:
    return None
  if weight.shape[2] != weight.shape[3]:
    reader.problems.append(f"{name}.weight: shape {weight.shape}, patches of "
                           f"{weight.shape[2]}x{weight.shape[3]}: vmoe's are square")
    return None
  if weight.shape[1] != 3:
    reader.problems.append(f"{name}.weight: shape {weight.shape}, {weight.shape[1]} input "
                           "channels: vmoe's images have 3")
  out["embedding_kernel"] = weight.transpose(2, 3, 1, 0)
  bias = reader.take(f"{name}.bias", (weight.shape[0],), optional=True)
  out["embedding_bias"] = np.zeros(weight.shape[0], np.float32) if bias is None else bias
  return weight.shape[2]


def square_side(tokens: int) -> int | None:
  side = math.isqrt(tokens)
  return side if side * side == tokens and side > 0 else None


def finish(problems: list[str], where: str, what: str, out: dict) -> dict:
  """`out` with no None left, or one CheckpointError listing every problem (the first few)."""
  if problems:
    shown_ = "; ".join(problems[:_SHOWN])
    more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    raise CheckpointError(f"init.checkpoint={where} is {what}, whose tensors do not map onto "
                          f"vmoe's ViT ({len(problems)} problem(s)): {shown_}{more}.")
  return out


def refuse(where: str, what: str, why: str) -> CheckpointError:
  """The error for a variant vmoe does not reproduce, named with the format found."""
  return CheckpointError(f"init.checkpoint={where} is {what}, which vmoe cannot run as its "
                         f"own ViT: {why}.")

