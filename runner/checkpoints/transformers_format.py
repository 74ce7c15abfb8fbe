"""transformers' ViTs (ViTModel, ViTForImageClassification, Dinov2Model,
Dinov2WithRegistersModel) as vmoe's ViT: the folder `save_pretrained` writes, config.json (its
model_type, sizes, hidden_act, layer_norm_eps, ...) beside model.safetensors or pytorch_model.bin.
config.json says everything the tensors do not. `convert` maps (ViT's names | DINOv2's):

  embeddings.patch_embeddings.projection     embedding_kernel, embedding_bias
  embeddings.cls_token, position_embeddings  cls (its position row folded in), pos_embedding
  embeddings.register_tokens (DINOv2)        registers (they have no position row)
  embeddings.mask_token                      left out: masked image modelling's, unused here
  encoder.layer.i.layernorm_before | norm1   block_i/norm1
  ...attention.attention.query, key, value   block_i/attention/qkv_kernel, qkv_bias
  ...attention.output.dense                  block_i/attention/out_kernel, out_bias
  ...layer_scale1.lambda1, layer_scale2...   block_i/ls1, ls2 (DINOv2)
  ...layernorm_after | norm2                 block_i/norm2
  ...intermediate.dense | mlp.fc1            block_i/mlp/fc1
  ...output.dense | mlp.fc2                  block_i/mlp/fc2
  layernorm                                  encoder_norm
  pooler.dense (ViTModel; tanh)              pre_logits (model.representation_size)
  classifier (ViTForImageClassification)     head

The models run at their config.json resolution, where transformers adds the position embeddings
as stored (it interpolates them only at another size)."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from runner.checkpoints import pytorch_vit as pv

KIND = "transformers ViT"
MODEL_TYPES = ("vit", "dinov2", "dinov2_with_registers")
# hidden_act -> model.activation: the tanh GELUs are one function (gelu_new, gelu_fast and
# PyTorch's tanh approximation write the same formula).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "quick_gelu": "quick_gelu"}
# Each model type's names within a layer: (norm1, norm2, fc1, fc2).
_LAYER = {"vit": ("layernorm_before", "layernorm_after", "intermediate.dense", "output.dense"),
          "dinov2": ("norm1", "norm2", "mlp.fc1", "mlp.fc2")}
# Each model type's layer_norm_eps when config.json does not give it (its config class's).
_EPS = {"vit": 1e-12, "dinov2": 1e-6}
_NOT_VITS = {"resnet", "swin", "swinv2", "convnext", "convnextv2", "regnet", "efficientnet",
             "mobilenet_v2", "levit", "poolformer", "bit", "van", "cvt", "focalnet"}


def _square(config: dict, key: str, where: str, what: str) -> int:
  value = config.get(key)
  if isinstance(value, (list, tuple)):
    if len(set(value)) != 1:
      raise pv.refuse(where, what, f"its {key} is {list(value)}; vmoe's are square")
    value = value[0]
  return int(value)


def _checked(config: dict, where: str) -> tuple[str, str, str]:
  """(model type, name, what to call the checkpoint); refused: another model type, or a variant."""
  model_type = str(config.get("model_type") or "")
  name = ", ".join(config.get("architectures") or []) or model_type or "no architectures"
  what = f"a {KIND} ({name}, model_type {model_type})"
  if model_type not in MODEL_TYPES:
    other = f"a transformers {model_type or 'model'} ({name})"
    why = ("not a ViT" if model_type in _NOT_VITS else "a model vmoe does not read")
    raise pv.refuse(where, other, f"it is {why}; vmoe reads transformers' model_type vit "
                    "(ViTModel, ViTForImageClassification) and dinov2, dinov2_with_registers "
                    "(Dinov2Model, Dinov2WithRegistersModel)")
  if any(a.startswith("Dinov2") and a.endswith("ForImageClassification")
         for a in config.get("architectures") or []):
    raise pv.refuse(where, what, "its classifier reads the class token and the patches' mean "
                    "side by side; vmoe's head reads one pooled representation (give the "
                    "backbone, Dinov2Model, and fine-tune a head)")
  if config.get("use_swiglu_ffn"):
    raise pv.refuse(where, what, "its MLPs are gated (use_swiglu_ffn=true, SwiGLU); vmoe's MLPs "
                    "are not")
  if (act := str(config.get("hidden_act", "gelu"))) not in _ACTIVATIONS:
    raise pv.refuse(where, what, f"its MLPs' activation is hidden_act={act!r}; vmoe runs "
                    f"{', '.join(_ACTIVATIONS)}")
  if model_type == "vit" and config.get("pooler_act", "tanh") != "tanh":
    raise pv.refuse(where, what, f"its pooler's activation is {config['pooler_act']!r}; vmoe's "
                    "representation layer is a tanh")
  return model_type, name, what


def convert(tensors: Mapping[str, np.ndarray], config: dict,
            where: str) -> tuple[dict, pv.Architecture]:
  """(our flat parameters, the architecture) of a transformers ViT folder's tensors and
  config.json; every problem in one CheckpointError. Stand-in arrays (shapes only) check a
  checkpoint without reading it."""
  model_type, name, what = _checked(config, where)
  family = "vit" if model_type == "vit" else "dinov2"
  prefix = next((p for p in (f"{family}.",) if any(n.startswith(p) for n in tensors)), "")
  d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
  layers = int(config["num_hidden_layers"])
  mlp = (int(config["intermediate_size"]) if family == "vit"
         else int(d * float(config.get("mlp_ratio", 4))))
  size, patch = _square(config, "image_size", where, what), _square(config, "patch_size", where,
                                                                     what)
  if d % heads:
    raise pv.refuse(where, what, f"its hidden_size {d} is not divisible by "
                    f"num_attention_heads {heads}")
  if int(config.get("num_channels", 3)) != 3:
    raise pv.refuse(where, what, f"its images have num_channels={config['num_channels']}; "
                    "vmoe's have 3")
  problems: list[str] = []
  reader = pv.Reader(tensors, problems)
  out: dict = {}
  e = f"{prefix}embeddings"
  if pv.patch_embedding(reader, f"{e}.patch_embeddings.projection", d, out) not in (None, patch):
    problems.append(f"{e}.patch_embeddings.projection.weight: patches of "
                    f"{out['embedding_kernel'].shape[0]}, config.json's patch_size is {patch}")
  patches = (size // patch) ** 2
  cls = reader.take(f"{e}.cls_token", (1, 1, d))
  pos = reader.take(f"{e}.position_embeddings", (1, patches + 1, d))
  if cls is not None and pos is not None:  # exact: the class token's input is cls + its row
    out["cls"], out["pos_embedding"] = cls + pos[:, :1], pos[:, 1:]
  registers = int(config.get("num_register_tokens", 0)) if model_type != "vit" else 0
  if registers:
    out["registers"] = reader.take(f"{e}.register_tokens", (1, registers, d))
  reader.drop(f"{e}.mask_token")

  norm1, norm2, fc1, fc2 = _LAYER[family]
  layer_scale = family == "dinov2"
  for i in range(layers):
    layer, ours = f"{prefix}encoder.layer.{i}", f"block_{i}"
    pv.norm(reader, f"{layer}.{norm1}", d, out, f"{ours}/norm1")
    a = f"{layer}.attention"
    pv.attention(*(pv.weight_and_bias(reader, f"{a}.attention.{p}", d, d)
                   for p in ("query", "key", "value")),
                 pv.weight_and_bias(reader, f"{a}.output.dense", d, d), heads, out,
                 f"{ours}/attention")
    pv.norm(reader, f"{layer}.{norm2}", d, out, f"{ours}/norm2")
    pv.linear(reader, f"{layer}.{fc1}", d, mlp, out, f"{ours}/mlp/fc1")
    pv.linear(reader, f"{layer}.{fc2}", mlp, d, out, f"{ours}/mlp/fc2")
    if layer_scale:
      out[f"{ours}/ls1"] = reader.take(f"{layer}.layer_scale1.lambda1", (d,))
      out[f"{ours}/ls2"] = reader.take(f"{layer}.layer_scale2.lambda1", (d,))
  pv.norm(reader, f"{prefix}layernorm", d, out, "encoder_norm")

  representation = None
  if reader.has(f"{prefix}pooler.dense.weight"):  # ViTModel's pooler: tanh(dense(class token))
    representation = reader.shape(f"{prefix}pooler.dense.weight")[0]
    pv.linear(reader, f"{prefix}pooler.dense", d, representation, out, "pre_logits")
  classes = None
  if reader.has("classifier.weight"):
    classes = reader.shape("classifier.weight")[0]
    pv.linear(reader, "classifier", representation or d, classes, out, "head")
  reader.unmapped()
  stated = {"image_size": size, "patch_size": patch, "hidden_size": d, "num_layers": layers,
            "mlp_dim": mlp, "num_heads": heads, "classifier": "token",
            "representation_size": representation,
            "activation": _ACTIVATIONS[str(config.get("hidden_act", "gelu"))],
            "layer_norm_eps": float(config.get("layer_norm_eps", _EPS[family])),
            "registers": registers,
            "layer_scale": layer_scale, "pre_norm": False, "fc_norm": False}
  init = config.get("layerscale_value") if layer_scale else None
  architecture = pv.Architecture(KIND, name, stated, (), classes, float(init) if init else None)
  return pv.finish(problems, where, what, out), architecture
