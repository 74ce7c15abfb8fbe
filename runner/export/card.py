"""What an export says about itself besides the weights: how pixels become inputs (config.json's
`preprocessing`) and the model card (README.md), as Hugging Face model folders carry one."""
from __future__ import annotations

import json

from runner.config import preprocessing


def preprocessing_entry(spec: str, image_size: int, channels: int) -> dict:
  """config.json's `preprocessing`: the spec vmoe evaluates with, and the affine map
  inputs = pixels * scale + offset that its value_range applies (none: pixels as they are)."""
  value_range = None
  for name, args, kwargs in preprocessing.steps(spec):
    if name == "value_range":
      given = preprocessing.value_range_arguments(args, kwargs)
      value_range = tuple(float(given[n]) for n in ("vmin", "vmax", "in_min", "in_max"))
  vmin, vmax, in_min, in_max = value_range or (0.0, 255.0, 0.0, 255.0)
  scale = (vmax - vmin) / (in_max - in_min)
  offset = vmin - in_min * scale
  return {"spec": spec, "image_size": image_size, "channels": channels,
          "pixel_range": [in_min, in_max], "input_range": [vmin, vmax], "scale": scale,
          "offset": offset, "formula": f"inputs = {_affine('pixels', scale, offset)}"}


def _affine(name: str, scale: float, offset: float) -> str:
  """`pixels * 0.00784 - 1` as one would write it."""
  text = name if scale == 1 else f"{name} * {scale:.10g}"
  return text if offset == 0 else f"{text} {'-' if offset < 0 else '+'} {abs(offset):.10g}"


# Sections of a summary that describe the training, not the model's quality.
_NOT_QUALITY = ("train/", "moe/", "compute/")


def _metrics(summary: dict) -> list[str]:
  rows = [(k, v) for k, v in summary.items()
          if isinstance(v, float) and not k.startswith(_NOT_QUALITY)
          and not any(part in k for part in ("/sev_", "images_per_s", "/moe/", "/routing/"))]
  if not rows:
    return ["The source run recorded no final metrics (a released checkpoint, or a run without "
            "a summary)."]
  return ["| metric | value |", "|---|---|"] + [f"| `{k}` | {v:.4f} |" for k, v in rows[:40]]


def model_card(config: dict, *, source: dict, summary: dict, parity: dict) -> str:
  """README.md of the export folder."""
  moe = config.get("moe")
  router = (moe or {}).get("router") or {}
  kind = (f"V-MoE with {moe['num_experts']} experts in blocks {moe['layers']}, router "
          f"`{router.get('type')}`" if moe else "dense ViT")
  if moe and moe.get("ensemble_size", 1) > 1:
    kind += f", a partitioned batch ensemble of {moe['ensemble_size']} members"
  if moe and "expert_mlp_dim" in moe:
    kind += f", fine-grained experts of width {moe['expert_mlp_dim']}"
  if moe and moe.get("shared_experts"):
    kind += f", {moe['shared_experts']} shared expert(s) that every token passes through"
  pp = config["preprocessing"]
  size, mode = pp["image_size"], "L" if pp["channels"] == 1 else "RGB"
  if moe and moe["group_size"] > 1:
    batches = (f"Any batch size works. The MoE layers route groups of {moe['group_size']} "
               "consecutive images of the batch together, so a prediction can depend on the "
               "other images of its group: a batch smaller than a group is one group, and a "
               "short last group is completed with zero images, as `vmoe eval` pads its last "
               "batch (their rows are not returned).")
  else:
    batches = "Any batch size works; each image's prediction is its own."
  if parity.get("checked"):
    checked = (f"Checked when exported: on {parity['images']} random images the PyTorch model's "
               f"probabilities differed from vmoe's by at most {parity['max_abs_diff']:.2e}.")
  else:
    checked = f"Not checked when exported: {parity['reason']}."
  lines = [
      f"# {config.get('name') or 'vmoe model'}", "",
      f"A {kind}; {config['num_layers']} blocks of width {config['hidden_size']}, "
      f"{config['image_size']}x{config['image_size']} images in patches of "
      f"{config['patch_size']}, {config['num_classes']} classes ({config['output']}).", "",
      "Exported by `vmoe export` from:", "",
      "```", json.dumps(source, indent=1), "```", "",
      "## Load it in PyTorch", "",
      "```python",
      "import importlib.util",
      "import numpy as np, torch",
      "from PIL import Image",
      "spec = importlib.util.spec_from_file_location('modeling_vmoe', 'modeling_vmoe.py')",
      "modeling = importlib.util.module_from_spec(spec); spec.loader.exec_module(modeling)",
      "model = modeling.load('.')  # eval mode",
      "paths = ['first.jpg', 'second.png', 'third.jpg']  # your images, as many as you like",
      f"images = [Image.open(p).convert('{mode}').resize(({size}, {size}), Image.BILINEAR) "
      "for p in paths]",
      "pixels = torch.from_numpy(np.stack([np.atleast_3d(np.asarray(im, np.float32)) "
      "for im in images]))",
      "pixels = pixels.permute(0, 3, 1, 2)  # (batch, channels, height, width)",
      "with torch.no_grad():",
      f"  probs = model.predict_proba({_affine('pixels', pp['scale'], pp['offset'])})"
      "  # (len(paths), classes)",
      "```", "",
      f"`pixels`: float32 (batch, {pp['channels']}, {size}, {size}), values in "
      f"{pp['pixel_range']}; inputs then lie in {pp['input_range']}. vmoe preprocesses with "
      f"`{pp['spec']}`, which the PIL resize above only approximates: where predictions must "
      "equal vmoe's, preprocess as that spec does.", "", batches, "",
      "## Parity", "", checked, "",
      "## Metrics of the source run", "", *_metrics(summary), "",
      "## What is and is not here", "",
      "Everything inference uses: every parameter (`model.safetensors`), the routing at the "
      "inference settings in `config.json`. Not here: the optimizer state, the training noise "
      "of routers and heads, auxiliary losses and dropout (training only).", ""]
  return "\n".join(lines)
