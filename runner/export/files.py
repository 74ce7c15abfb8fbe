"""Writes an export folder: model.safetensors, config.json and modeling_vmoe.py."""
from __future__ import annotations

import json
import pathlib
from typing import Mapping

import numpy as np
from safetensors.numpy import save_file

from runner.config import derived
from runner.config.relations import relation
from runner.config.schema import ExportRun, ModelConfig
from runner.export import architecture, layout

# What an export folder holds (runner/export, runner/tasks/export.py) besides Hydra's record of
# the command (.hydra/, a .log), the workdir lock (.vmoe.lock, runner/workdirs/workdir_lock.py)
# and Python's cache of modeling_vmoe.py once a user imported it there (__pycache__/): a rerun
# may replace these, nothing else.
EXPORT_FILES = ("model.safetensors", "config.json", "modeling_vmoe.py", "README.md", "summary.json")
_EXPORT_BOOKKEEPING = (".hydra", ".vmoe.lock", "__pycache__")

TEMPLATE = pathlib.Path(__file__).with_name("modeling_vmoe.py")
MARKER = "# ---- router families (added by vmoe export) ----"


def modeling_source(model: ModelConfig) -> str:
  """The template of modeling_vmoe.py with the model's router family appended at its marker
  line, and registered in ROUTERS under the family's name."""
  template = TEMPLATE.read_text()
  if template.count(MARKER) != 1:
    raise RuntimeError(f"{TEMPLATE} must hold the line {MARKER!r} once")
  if not derived.num_experts(model):
    return template
  routing = architecture.torch_routing(model)
  if routing is None:
    raise ValueError(architecture.unsupported(model))
  name = derived.router_family(model).name
  family = (f"{MARKER}\n\n{routing.source.strip()}\n\n\n"
            f"ROUTERS[{json.dumps(name)}] = {routing.class_name}")
  return template.replace(MARKER, family)


def write_model(directory, *, params: Mapping, model: ModelConfig, num_classes: int, output: str,
                extra_config: dict | None = None) -> dict:
  """Writes `params` (the Flax parameter tree of `model` with a head of `num_classes`) as a
  PyTorch model folder in `directory`; returns the config.json it wrote (`extra_config` merged
  in, e.g. the preprocessing and where the weights came from)."""
  if problem := architecture.unsupported(model):
    raise ValueError(problem)
  tensors = layout.torch_state_dict(params, model)
  config = architecture.config_json(model, num_classes, output)
  config["num_channels"] = int(tensors["embedding.weight"].shape[1])
  head = tensors.get("head.weight", tensors.get("head.loc_layer.weight"))
  if head is not None and head.shape[0] != num_classes:
    raise ValueError(f"the parameters' head predicts {head.shape[0]} classes, not {num_classes}")
  config.update(extra_config or {})
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
            str(directory / "model.safetensors"), metadata={"format": "pt"})
  (directory / "model.safetensors").chmod(0o644)  # safetensors writes it private to its owner
  (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  (directory / "modeling_vmoe.py").write_text(modeling_source(model))
  return config


@relation
def export_folder_holds_no_other_files(run: ExportRun):
  """workdir= receives the export: it must be new, empty, or a former export of vmoe (which a
  rerun replaces), never a run's folder or anything else a user keeps there."""
  folder = pathlib.Path(run.workdir).expanduser() if run.workdir else None
  if folder is None or not folder.is_dir():
    return None
  if others := sorted(p.name for p in folder.iterdir()
                     if p.name not in EXPORT_FILES + _EXPORT_BOOKKEEPING and p.suffix != ".log"):
    shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    return (f"workdir={run.workdir} holds files that are not an export of vmoe ({shown}); vmoe "
            f"export writes {', '.join(EXPORT_FILES)} into a new or empty folder (or replaces "
            "a former export): choose another workdir=<folder>.")
  return None
