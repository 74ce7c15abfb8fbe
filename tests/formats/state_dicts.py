"""timm- and transformers-named random tensors, written with safetensors' NumPy API (no PyTorch):
checkpoints of these libraries' ViTs, or of what vmoe refuses, for tests that run without torch
(the comparisons with the libraries themselves are tests/export/test_timm_transformers.py's)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import safetensors.numpy

WIDTH = 192  # one of timm's standard widths: 3 heads, which a bare state_dict does not store


def _random(shapes: dict[str, tuple], seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {name: (0.1 * rng.standard_normal(shape)).astype(np.float32)
          for name, shape in shapes.items()}


def timm_shapes(d: int = WIDTH, layers: int = 1, mlp: int = 2 * WIDTH, patch: int = 8,
                image: int = 32, classes: int = 10) -> dict[str, tuple]:
  """timm's VisionTransformer with a class token, its position embedding's first row."""
  shapes = {"cls_token": (1, 1, d), "pos_embed": (1, (image // patch) ** 2 + 1, d),
            "patch_embed.proj.weight": (d, 3, patch, patch), "patch_embed.proj.bias": (d,),
            "norm.weight": (d,), "norm.bias": (d,), "head.weight": (classes, d),
            "head.bias": (classes,)}
  for i in range(layers):
    b = f"blocks.{i}"
    shapes.update({f"{b}.norm1.weight": (d,), f"{b}.norm1.bias": (d,),
                   f"{b}.attn.qkv.weight": (3 * d, d), f"{b}.attn.qkv.bias": (3 * d,),
                   f"{b}.attn.proj.weight": (d, d), f"{b}.attn.proj.bias": (d,),
                   f"{b}.norm2.weight": (d,), f"{b}.norm2.bias": (d,),
                   f"{b}.mlp.fc1.weight": (mlp, d), f"{b}.mlp.fc1.bias": (mlp,),
                   f"{b}.mlp.fc2.weight": (d, mlp), f"{b}.mlp.fc2.bias": (d,)})
  return shapes


def vit_shapes(d: int = 32, layers: int = 1, mlp: int = 64, patch: int = 8, image: int = 32,
               classes: int = 10) -> dict[str, tuple]:
  """transformers' ViTForImageClassification."""
  e = "vit.embeddings"
  shapes = {f"{e}.cls_token": (1, 1, d), f"{e}.position_embeddings": (1, (image // patch) ** 2 + 1, d),
            f"{e}.patch_embeddings.projection.weight": (d, 3, patch, patch),
            f"{e}.patch_embeddings.projection.bias": (d,), "vit.layernorm.weight": (d,),
            "vit.layernorm.bias": (d,), "classifier.weight": (classes, d),
            "classifier.bias": (classes,)}
  for i in range(layers):
    layer = f"vit.encoder.layer.{i}"
    for p in ("query", "key", "value"):
      shapes.update({f"{layer}.attention.attention.{p}.weight": (d, d),
                     f"{layer}.attention.attention.{p}.bias": (d,)})
    shapes.update({f"{layer}.attention.output.dense.weight": (d, d),
                   f"{layer}.attention.output.dense.bias": (d,),
                   f"{layer}.intermediate.dense.weight": (mlp, d),
                   f"{layer}.intermediate.dense.bias": (mlp,),
                   f"{layer}.output.dense.weight": (d, mlp), f"{layer}.output.dense.bias": (d,)})
    for norm in ("layernorm_before", "layernorm_after"):
      shapes.update({f"{layer}.{norm}.weight": (d,), f"{layer}.{norm}.bias": (d,)})
  return shapes


VIT_CONFIG = {"architectures": ["ViTForImageClassification"], "model_type": "vit",
              "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 64, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
              "image_size": 32, "patch_size": 8, "num_channels": 3, "qkv_bias": True}


def write(path: pathlib.Path, shapes: dict[str, tuple], seed: int = 0) -> pathlib.Path:
  """A .safetensors file of random tensors of `shapes`."""
  path.parent.mkdir(parents=True, exist_ok=True)
  safetensors.numpy.save_file(_random(shapes, seed), str(path))
  return path


def folder(path: pathlib.Path, config: dict, shapes: dict[str, tuple],
           seed: int = 0) -> pathlib.Path:
  """A folder as timm's save_for_hf or transformers' save_pretrained writes it: config.json and
  model.safetensors."""
  write(path / "model.safetensors", shapes, seed)
  (path / "config.json").write_text(json.dumps(config))
  return path
