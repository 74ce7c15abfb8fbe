"""`vmoe export init.checkpoint=<run> workdir=<out>`: a checkpoint as a PyTorch model folder.

Writes model.safetensors, config.json and modeling_vmoe.py (runner/export/files.py), a model card
and summary.json; then, where PyTorch is installed, runs the folder's model in a process without
JAX on random images and compares its probabilities with this model's (the export fails if they
differ by more than 1e-4; a heteroscedastic head samples its noise: reported, not enforced). What
can be refused (a run still going or unfinished, a folder holding something else, a model the
exporter cannot express) was refused before this runs (runner/config/relations.py)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors import safe_open

from runner.checkpoints import weights
from runner.config import derived
from runner.config.schema import ExportRun, HeadType
from runner.errors import RunError
from runner.losses.classification import probabilities
from runner.models.size import count_params
from runner.export import card, files, parity
from runner.models import build_model, heads
from runner.parallel import Placement
from runner.stages import setup

CHECK_IMAGES = 16  # at most; whole routing groups of the model


def run(config: ExportRun, placement: Placement, checkpoints: weights.Checkpoints) -> dict:
  del placement  # one host process writes the folder
  path = config.init.checkpoint
  opened = checkpoints.open(path)
  params, stored, step = opened.load(ensemble_size=derived.ensemble_size(config.model))
  num_classes, output = heads.num_classes(params), derived.model_output(config.loss)
  model = build_model(config.model, num_classes, output=output)
  channels = int(params["embedding_kernel"].shape[2])
  size = config.model.image_size
  setup.check_params_fit(path, step, params, model, (size, size, channels), "export")
  out = pathlib.Path(config.workdir)
  out.mkdir(parents=True, exist_ok=True)
  source = {"checkpoint": str(path), "step": step,
            "stage": (stored or {}).get("stage", "released"), "model": config.model.name}
  pp = card.preprocessing_entry(config.data.pp, size, channels)
  extra = {"name": config.model.name, "source": source, "preprocessing": pp}
  exported = files.write_model(out, params=params, model=config.model, num_classes=num_classes,
                               output=output, extra_config=extra)
  check = _check(out, model, params, config, pp)
  with safe_open(str(out / "model.safetensors"), framework="numpy") as tensors:
    tensor_count = len(list(tensors.keys()))
  summary = {"checkpoint_step": step, "export/tensors": tensor_count,
             "export/parameters": count_params(params),
             "export/checked": bool(check.get("checked"))}
  if check.get("checked"):
    summary["export/max_abs_diff"] = check["max_abs_diff"]
  folder = opened.run_folder
  source_summary = _read_json(folder / "summary.json") if folder else {}
  (out / "README.md").write_text(card.model_card(exported, source=source, summary=source_summary,
                                                 parity=check))
  (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
  print(f"vmoe export: {out} ({summary['export/tensors']} tensors, "
        f"{summary['export/parameters']:,} parameters); "
        + (f"PyTorch matches vmoe to {check['max_abs_diff']:.1e}" if check.get("checked")
           else f"not checked: {check['reason']}"))
  if check.get("checked") and check["enforced"] and check["max_abs_diff"] > parity.TOLERANCE:
    raise RunError(f"the exported model's probabilities differ from vmoe's by "
                   f"{check['max_abs_diff']:.2e} (> {parity.TOLERANCE}) on {check['images']} "
                   f"images: the export in {out} is wrong; please report it with its config.json.")
  return summary


def _check(out: pathlib.Path, model, params, config: ExportRun, pp: dict) -> dict:
  """Random images in the inputs' range (`pp`) through vmoe and the folder's PyTorch model."""
  if not parity.torch_installed():
    return {"checked": False, "reason": "PyTorch is not installed where vmoe ran "
            "(pip install -e '.[torch]' in the vmoe checkout adds it)"}
  group = config.model.moe.group_size if derived.num_experts(config.model) else 1
  count = group * max(1, CHECK_IMAGES // group)
  images = parity.check_images(pp["image_size"], pp["channels"], tuple(pp["input_range"]), count,
                               seed=config.seed)
  logits, _ = model.apply({"params": params}, images, train=False)
  ours = probabilities(logits, config.loss)
  theirs = parity.torch_probabilities(out, images.transpose(0, 3, 1, 2))
  return {"checked": True, "images": count, "max_abs_diff": float(np.abs(theirs - ours).max()),
          "enforced": config.model.head.type == HeadType.det}


def _read_json(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return {}
