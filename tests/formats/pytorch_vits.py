"""Small randomly initialised ViTs built by timm and transformers themselves, saved as those
libraries save them (`safetensors.torch.save_file`, `torch.save`, timm's `save_for_hf`,
transformers' `save_pretrained`), and the libraries' own forward pass: what tests/export compares
vmoe's reading of these files with. Needs torch, timm and transformers (`make test-export`).

Every parameter is drawn afresh (`perturb`) with a spread that makes the predictions differ
clearly from image to image and from class to class: the libraries' own initialisations (0.02
std, zero biases, layer scales of 1e-5) would give nearly uniform outputs, which any reading of
the weights would reproduce to 1e-5."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys

import numpy as np
import torch


def libraries():
  """(timm, transformers). timm imports torchvision, whose Linux wheels on PyPI are CUDA builds:
  beside PyTorch's CPU build their C++ operators cannot load, and torchvision 0.28's import then
  fails declaring fakes for two of them (`operator torchvision::nms does not exist`). No ViT calls
  those operators (detection's non-maximum suppression): their schemas are declared, without
  kernels, for torchvision's import to finish. A torchvision whose operators load needs none."""
  try:
    import torchvision  # noqa: F401
  except RuntimeError as e:
    if "torchvision::" not in str(e):
      raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
      del sys.modules[name]
    for op in ("nms", "qnms"):
      torch.library.define(f"torchvision::{op}",
                           "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
  import timm
  import transformers
  return timm, transformers


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
  """Every parameter redrawn: matrices N(0, 1/fan_in), LayerNorm scales and layer scales near
  1 and 0.5, everything else (biases, tokens, position embeddings) N(0, 0.3^2). In eval mode."""
  g = torch.Generator().manual_seed(seed)
  for name, p in model.named_parameters():
    noise = torch.randn(p.shape, generator=g)
    if p.ndim >= 2 and not name.endswith(("token", "tokens", "pos_embed", "position_embeddings",
                                          "latent")):
      p.copy_(noise / math.sqrt(math.prod(p.shape[1:])))
    elif "norm" in name and name.endswith("weight"):
      p.copy_(1 + 0.2 * noise)
    elif name.endswith(("gamma", "lambda1")):
      p.copy_(0.5 + 0.2 * noise)
    else:
      p.copy_(0.3 * noise)
  return model.eval()


@dataclasses.dataclass
class Built:
  """A saved model: the path init.checkpoint takes, the library model, whether its output is
  logits (else features: a backbone), and what the files do not say (the keys a command adds)."""
  path: pathlib.Path
  model: torch.nn.Module
  logits: bool
  given: dict = dataclasses.field(default_factory=dict)

  @torch.no_grad()
  def forward(self, images_nchw: np.ndarray) -> np.ndarray:
    """The library's own forward pass: logits of a classifier, a backbone's pooled features."""
    x = torch.from_numpy(np.ascontiguousarray(images_nchw, np.float32))
    out = self.model(x) if not hasattr(self.model, "config") else self.model(pixel_values=x)
    if hasattr(out, "logits"):
      out = out.logits
    elif hasattr(out, "pooler_output"):
      out = out.pooler_output
    return out.numpy().astype(np.float64)


def timm_vit(folder: pathlib.Path, name: str, *, save: str, seed: int = 0, classes: int = 10,
             image: int = 32, patch: int = 8, width: int = 192, heads: int = 3, depth: int = 2,
             activation: str | None = None, architecture: str | None = None, **kwargs) -> Built:
  """timm's VisionTransformer with `kwargs` (its own arguments), saved as `save`: "safetensors",
  "pth" or "bin" (a bare state_dict file; its width must be one of timm's standard ones, which
  give the head count), or "folder" / "folder_safetensors": timm.create_model(`architecture`,
  **those arguments) saved by timm's save_for_hf (config.json: the architecture, the arguments
  as model_args)."""
  timm, _ = libraries()
  from timm.models import _hub
  from timm.models.vision_transformer import VisionTransformer
  torch.manual_seed(seed)
  args = dict(img_size=image, patch_size=patch, embed_dim=width, depth=depth, num_heads=heads,
              mlp_ratio=2.0, num_classes=classes, **kwargs)
  if activation:
    args["act_layer"] = activation
  if save.startswith("folder"):
    model = perturb(timm.create_model(architecture, pretrained=False, **args), seed)
    path = folder / name
    _hub.save_for_hf(model, str(path), model_args=args,
                     safe_serialization=save == "folder_safetensors")
    assert json.loads((path / "config.json").read_text())["architecture"] == architecture
    return Built(path, model, classes > 0)
  model = perturb(VisionTransformer(**args), seed)
  path = folder / f"{name}.{save}"
  if save == "safetensors":
    import safetensors.torch
    safetensors.torch.save_file(model.state_dict(), str(path))
  else:
    torch.save(model.state_dict(), path)
  return Built(path, model, classes > 0, {"activation": activation or "gelu"})  # not stored


def transformers_vit(folder: pathlib.Path, name: str, kind: str, *, seed: int = 0,
                     **config) -> Built:
  """transformers' `kind` (ViTForImageClassification, ViTModel, Dinov2Model,
  Dinov2WithRegistersModel) of a small config, perturbed, saved by save_pretrained."""
  _, transformers = libraries()
  torch.manual_seed(seed)
  config_class = getattr(transformers, kind.replace("ForImageClassification", "Config")
                         .replace("Model", "Config"))
  model = perturb(getattr(transformers, kind)(config_class(**config)), seed)
  path = folder / name
  model.save_pretrained(str(path))
  return Built(path, model, kind.endswith("ForImageClassification"))
