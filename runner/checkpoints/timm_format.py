"""timm's VisionTransformer (timm/models/vision_transformer.py) as vmoe's ViT.

A timm ViT is a state_dict, as `.safetensors` or a `.pth`/`.bin` pickle, alone or in the folder
timm's `save_for_hf` / `push_to_hub` writes (the weights beside a config.json naming the
architecture, `global_pool` and, when given, `model_args`). The tensors say the sizes, the class
and register tokens, layer scale, the pre-norm, fc_norm and the MAP head; config.json says the
pooling and, for most architectures, the activation. A bare state_dict stores neither the head
count (timm's standard widths give it) nor the activation (the command gives it). `convert` maps:

  patch_embed.proj (D, C, p, p)       embedding_kernel (p, p, C, D); no bias (CLIP): zeros
  cls_token, reg_token, pos_embed     cls, registers, pos_embedding; a prefix token's row of
                                      pos_embed (no_embed_class=False) folded into that token
  norm_pre                            pre_norm (timm's CLIP ViTs: LayerNorm eps 1e-5)
  blocks.i.norm1, norm2               block_i/norm1, norm2
  blocks.i.attn.qkv (3D, D)           block_i/attention/qkv_kernel (D, 3, H, hd); no bias: zeros
  blocks.i.attn.proj                  block_i/attention/out_kernel (H, hd, D), out_bias
  blocks.i.ls1.gamma, ls2.gamma       block_i/ls1, ls2 (model.layer_scale)
  blocks.i.mlp.fc1, fc2               block_i/mlp/fc1, fc2
  norm, fc_norm                       encoder_norm, fc_norm (average pooling: model.fc_norm)
  attn_pool (latent, q, kv, proj,     map_head (probe, attention query / key + value / out,
  norm, mlp)                          norm, mlp): classifier=map
  head                                head

A class token that pooling does not read (average or attention pooling) is a register for vmoe:
timm leaves every prefix token out of pooling, as vmoe leaves its registers."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from runner.checkpoints import pytorch_vit as pv

KIND = "timm ViT"
# The head count of timm's named ViT widths (vit_tiny ... vit_gigantic, DINOv2's, SigLIP's
# so400m, vit_medium, vit_betwixt), which a bare state_dict does not store.
STANDARD_HEADS = {192: 3, 384: 6, 512: 8, 640: 10, 768: 12, 1024: 16, 1152: 16, 1280: 16,
                  1408: 16, 1536: 24, 1664: 16}
_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}
_POOLS = {"token": "token", "avg": "gap", "map": "map"}
# Tensors of variants vmoe's ViT does not have, and why, by the name that gives them away.
_REFUSED = {
    "dist_token": "a distillation token (DeiT's distilled models)",
    "head_dist.": "a distillation head (DeiT's distilled models)",
    ".attn.q_norm.": "qk-norm with a bias (qk_norm=True); vmoe's qk-norm (model."
                     "attention_qk_norm) has a scale only",
    ".attn.norm.": "a LayerNorm inside attention (scale_attn_norm=True)",
    ".mlp.norm.": "a LayerNorm inside the MLP (scale_mlp_norm=True)",
    "patch_embed.norm.": "a LayerNorm in the patch embedding (embed_norm_layer)",
    "attn_pool.pos_embed": "position embeddings in the attention pooling",
    "attn_pool.q_norm.": "qk-norm in the attention pooling",
}


def is_timm(names) -> bool:
  """Whether tensor names are timm's VisionTransformer's (its patch embedding and blocks)."""
  names = set(names)
  return "patch_embed.proj.weight" in names and any(n.startswith("blocks.0.") for n in names)


def _model_args(config: dict | None) -> dict:
  return dict((config or {}).get("model_args") or {})


def _image_size(config: dict | None) -> int | None:
  """The resolution config.json gives (model_args.img_size, else pretrained_cfg.input_size);
  None where it gives none, or a non-square one."""
  size = _model_args(config).get("img_size")
  if size is None:
    input_size = ((config or {}).get("pretrained_cfg") or {}).get("input_size")
    size = list(input_size)[1:] if input_size else None
  if isinstance(size, (list, tuple)):
    size = size[0] if len(set(size)) == 1 else None
  return int(size) if size else None


def _heads(config: dict | None, width: int, where: str, what: str) -> int:
  """config.json's head count, else that of timm's standard width; refused where neither says."""
  if given := _model_args(config).get("num_heads"):
    return int(given)
  if width in STANDARD_HEADS:
    return STANDARD_HEADS[width]
  raise pv.refuse(where, what, f"its width {width} is none of timm's standard ones "
                  f"({', '.join(map(str, STANDARD_HEADS))}), and without config.json's "
                  "model_args.num_heads the head count is not stored: give the folder timm "
                  "writes (timm.models.save_for_hf) or a config.json beside the file with "
                  '{"architecture": ..., "model_args": {"num_heads": H}}')


def _activation(config: dict | None, where: str, what: str) -> str | None:
  """What config.json says of the activation; None when it does not say."""
  if (given := _model_args(config).get("act_layer")) is not None:
    if str(given) not in _ACTIVATIONS:
      raise pv.refuse(where, what, f"its MLPs' activation is {given!r} (model_args.act_layer); "
                      f"vmoe's are {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[str(given)]
  name = str((config or {}).get("architecture") or "")
  if not name or "siglip" in name:  # timm's SigLIP models use either GELU: not said
    return None
  return "quick_gelu" if "quickgelu" in name else "gelu"  # timm's default: exact GELU


def _layer_norm_eps(config: dict | None, pre_norm: bool) -> float:
  """timm's LayerNorm takes 1e-6; its CLIP ViTs (the ViTs with a norm_pre, vit_*_clip_*) take
  PyTorch's nn.LayerNorm default, 1e-5, as OpenAI's CLIP and OpenCLIP do."""
  name = str((config or {}).get("architecture") or "")
  return 1e-5 if pre_norm or "_clip" in name else 1e-6


def _pool(config: dict | None, reader: pv.Reader, where: str, what: str) -> str:
  """timm's global_pool: config.json's, else what the tensors imply."""
  args = _model_args(config)
  if args.get("pool_include_prefix"):
    raise pv.refuse(where, what, "its pooling includes the class and register tokens "
                    "(pool_include_prefix=True); vmoe pools the patches only")
  pool = args.get("global_pool", (config or {}).get("global_pool"))
  if pool is None:  # a bare state_dict: attention pooling, fc_norm (average), or a class token
    pool = ("map" if reader.has_prefix("attn_pool.") else "avg" if reader.has("fc_norm.weight")
            else "token" if reader.has("cls_token") else "avg")
  if pool == "":  # no pooling (a feature extractor): vmoe pools as the tokens allow
    pool = "token" if reader.has("cls_token") else "avg"
  if pool not in _POOLS:
    raise pv.refuse(where, what, f"its pooling is global_pool={pool!r}; vmoe pools by the class "
                    "token (token), the patches' mean (avg) or attention (map)")
  return pool


def convert(tensors: Mapping[str, np.ndarray], config: dict | None,
            where: str) -> tuple[dict, pv.Architecture]:
  """(our flat parameters, the architecture) of a timm ViT's state_dict and config.json (None for
  a bare file); every problem in one CheckpointError. Stand-in arrays (shapes only) check a
  checkpoint without reading it."""
  name = str((config or {}).get("architecture") or "a bare state_dict")
  what = f"a {KIND} ({name})"
  problems: list[str] = []
  reader = pv.Reader(tensors, problems)
  for marker, why in _REFUSED.items():
    if found := sorted(n for n in tensors if marker in n):
      problems.append(f"{found[0]}: {why}, which vmoe does not reproduce")
      for n in found:
        reader.drop(n)
  out: dict = {}
  patch = pv.patch_embedding(reader, "patch_embed.proj", None, out)
  if "embedding_kernel" not in out:  # its problem is recorded; the width is unknown
    pv.finish(problems, where, what, out)
  d = int(out["embedding_kernel"].shape[-1])
  heads = _heads(config, d, where, what)
  if d % heads:
    raise pv.refuse(where, what, f"its width {d} is not divisible by {heads} heads")
  layers = pv.count(tensors, "blocks.")
  fc1, fc2 = reader.shape("blocks.0.mlp.fc1.weight"), reader.shape("blocks.0.mlp.fc2.weight")
  mlp = fc1[0] if fc1 else None
  if fc1 and fc2 and fc2[1] != fc1[0]:
    raise pv.refuse(where, what, f"its MLPs are gated (SwiGLU: blocks.0.mlp.fc1 gives {fc1[0]} "
                    f"features, fc2 takes {fc2[1]}); vmoe's MLPs are not")
  activation = _activation(config, where, what)
  pool = _pool(config, reader, where, what)

  layer_scale = reader.has("blocks.0.ls1.gamma")
  for i in range(layers):
    block, ours = f"blocks.{i}", f"block_{i}"
    pv.norm(reader, f"{block}.norm1", d, out, f"{ours}/norm1")
    w, b = pv.weight_and_bias(reader, f"{block}.attn.qkv", d, 3 * d)
    q, k, v = ((None, None),) * 3 if w is None else (
        (w[j * d:(j + 1) * d], None if b is None else b[j * d:(j + 1) * d]) for j in range(3))
    pv.attention(q, k, v, pv.weight_and_bias(reader, f"{block}.attn.proj", d, d), heads, out,
                 f"{ours}/attention")
    pv.norm(reader, f"{block}.norm2", d, out, f"{ours}/norm2")
    pv.linear(reader, f"{block}.mlp.fc1", d, mlp, out, f"{ours}/mlp/fc1")
    pv.linear(reader, f"{block}.mlp.fc2", mlp, d, out, f"{ours}/mlp/fc2")
    if layer_scale:
      out[f"{ours}/ls1"] = reader.take(f"{block}.ls1.gamma", (d,))
      out[f"{ours}/ls2"] = reader.take(f"{block}.ls2.gamma", (d,))

  pre_norm = reader.has("norm_pre.weight")
  if pre_norm:
    pv.norm(reader, "norm_pre", d, out, "pre_norm")
  has_norm, has_fc = reader.has("norm.weight"), reader.has("fc_norm.weight")
  if not has_norm and not has_fc:
    raise pv.refuse(where, what, "it has no final LayerNorm (final_norm=False); vmoe's ViT ends "
                    "with one")
  if has_fc and pool == "map":
    raise pv.refuse(where, what, "its fc_norm follows the attention pooling; vmoe's final "
                    "LayerNorm comes before a MAP head")
  fc_norm = has_fc and pool == "avg"
  # fc_norm on the class token alone is the LayerNorm of that token: the encoder norm's.
  pv.norm(reader, "fc_norm" if has_fc else "norm", d, out, "fc_norm" if fc_norm else "encoder_norm")

  image_size = _prefix_and_positions(reader, config, d, patch, pool, out, problems)
  registers = int(out["registers"].shape[1]) if "registers" in out else 0
  if pool == "map":
    _map_head(reader, d, mlp, heads, out, problems)
  classes = None
  if reader.has("head.weight"):
    pv.linear(reader, "head", d, None, out, "head")
    classes = reader.shape("head.weight")[0]
  reader.unmapped()
  stated = {"image_size": image_size, "patch_size": patch, "hidden_size": d,
            "num_layers": layers, "mlp_dim": mlp, "num_heads": heads,
            "classifier": _POOLS[pool], "representation_size": None, "activation": activation,
            "layer_norm_eps": _layer_norm_eps(config, pre_norm), "registers": registers,
            "layer_scale": layer_scale, "pre_norm": pre_norm, "fc_norm": fc_norm}
  unstated = tuple(k for k in ("image_size", "activation") if stated[k] is None)
  init = _model_args(config).get("init_values")
  notes = (() if config else ("its pooling read from its tensors, its head count from its "
                              "width",))
  architecture = pv.Architecture(
      KIND, name, {k: v for k, v in stated.items() if k not in unstated}, unstated, classes,
      float(init) if init else None, notes)
  return pv.finish(problems, where, what, out), architecture


def _prefix_and_positions(reader: pv.Reader, config, d, patch, pool, out, problems) -> int | None:
  """cls, registers and pos_embedding: the class token (token pooling) or else the first
  register, timm's reg_token after it; a prefix row of pos_embed folded into its token (exact:
  that token's input is the constant token + row). Returns the image size."""
  cls = reader.take("cls_token", (1, 1, d), optional=True)
  regs = reader.take("reg_token", (1, None, d), optional=True)
  if pool == "token" and cls is None:
    problems.append("cls_token: missing (the model pools by its class token)")
  prefix = [t for t in (cls, regs) if t is not None]
  count = sum(t.shape[1] for t in prefix)
  pos = reader.take("pos_embed", (1, None, d), optional=True)
  size = _image_size(config)
  patches = (size // patch) ** 2 if size and patch else None
  no_embed_class = _model_args(config).get("no_embed_class")
  if pos is not None:
    rows = pos.shape[1]
    if no_embed_class is None:  # the rows say: a square grid with or without the prefix's rows
      with_prefix = (rows - count == patches if patches else
                     count > 0 and pv.square_side(rows - count) is not None)
    else:
      with_prefix = not no_embed_class and count > 0
    grid = rows - count if with_prefix else rows
    if pv.square_side(grid) is None or (patches and grid != patches):
      problems.append(f"pos_embed: shape {pos.shape}, not a square grid of patches"
                      + (f" after {count} class/register rows" if with_prefix else "")
                      + (f" ({patches} at {size} px)" if patches else ""))
      return size
    if with_prefix:
      at = 0
      for i, token in enumerate(prefix):
        prefix[i] = token + pos[:, at:at + token.shape[1]]
        at += token.shape[1]
      pos = pos[:, count:]
    out["pos_embedding"] = pos
    size = pv.square_side(grid) * patch
  elif patches:  # pos_embed='none': no position embeddings, the same as zeros
    out["pos_embedding"] = np.zeros((1, patches, d), np.float32)
  else:
    problems.append("pos_embed: missing, and config.json gives no image size")
  if pool == "token" and cls is not None:
    out["cls"] = prefix.pop(0)
  if prefix:
    out["registers"] = np.concatenate(prefix, axis=1)
  return size


def _map_head(reader: pv.Reader, d, mlp, heads, out, problems) -> None:
  """timm's AttentionPoolLatent as our MapHead: a one-token latent query, q and a fused kv
  projection, the output projection, then norm and MLP with a residual."""
  latent = reader.take("attn_pool.latent", (1, None, d))
  if latent is not None and latent.shape[1] != 1:
    problems.append(f"attn_pool.latent: shape {latent.shape}, {latent.shape[1]} latent queries; "
                    "vmoe's MAP head has one")
  out["map_head/probe"] = latent
  q = pv.weight_and_bias(reader, "attn_pool.q", d, d)
  w, b = pv.weight_and_bias(reader, "attn_pool.kv", d, 2 * d)
  k, v = ((None, None),) * 2 if w is None else (
      (w[j * d:(j + 1) * d], None if b is None else b[j * d:(j + 1) * d]) for j in range(2))
  pv.attention(q, k, v, pv.weight_and_bias(reader, "attn_pool.proj", d, d), heads, out,
               "map_head/attention", fused=False)
  pv.norm(reader, "attn_pool.norm", d, out, "map_head/norm")
  pv.linear(reader, "attn_pool.mlp.fc1", d, mlp, out, "map_head/mlp/fc1")
  pv.linear(reader, "attn_pool.mlp.fc2", mlp, d, out, "map_head/mlp/fc2")
