"""timm and transformers checkpoints on disk: which of them a path is, told from its files as the
other formats are; opened once with the tensors' shapes alone and mapped then (timm_format,
transformers_format), so that anything vmoe cannot run is refused before a command runs; its
arrays read only when loaded.

  a .safetensors / .pth / .pt / .bin file   a bare state_dict: timm's ViT, by its tensors' names
                                            (the folder's format when a config.json is beside it)
  a folder: config.json, model.safetensors  timm's (config.json names an `architecture`) or
  or pytorch_model.bin                      transformers' (it names a `model_type`)
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from runner.checkpoints import pytorch_vit, state_dicts, timm_format, transformers_format
from runner.errors import CheckpointError

WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # in a folder, the first found is read
_SHOWN = 5


@dataclasses.dataclass(frozen=True)
class PytorchCheckpoint:
  """A timm or transformers ViT, checked: its kind, weights file, config.json (None for a bare
  state_dict) and what its files say the model is."""
  kind: str
  weights: pathlib.Path
  config: dict | None
  architecture: pytorch_vit.Architecture
  where: str  # the path as given

  def load(self) -> dict[str, np.ndarray]:
    """Our flat parameter names (runner.models.transfer.flatten's) -> float32 arrays."""
    return _convert(self.kind, state_dicts.read(self.weights), self.config, self.where)[0]


def _convert(kind: str, tensors, config, where: str):
  if kind == timm_format.KIND:
    return timm_format.convert(tensors, config, where)
  return transformers_format.convert(tensors, config, where)


def _listed(names) -> str:
  names = sorted(names)
  more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
  return ", ".join(names[:_SHOWN]) + more if names else "none"


def _config(folder: pathlib.Path, where: str) -> dict:
  try:
    config = json.loads((folder / "config.json").read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"init.checkpoint={where}: its config.json cannot be read as JSON "
                          f"({e}).") from None
  if not isinstance(config, dict):
    raise CheckpointError(f"init.checkpoint={where}: its config.json is not a JSON object.")
  return config


def _weights(folder: pathlib.Path, where: str, what: str) -> pathlib.Path:
  for name in WEIGHTS:
    if (folder / name).is_file():
      return folder / name
  if sharded := sorted(p.name for p in folder.glob("*.index.json")):
    raise CheckpointError(f"init.checkpoint={where} is {what} whose weights are sharded "
                          f"({sharded[0]}); vmoe reads one file: {' or '.join(WEIGHTS)}.")
  raise CheckpointError(f"init.checkpoint={where} is {what} (config.json) without its weights: "
                        f"expected {' or '.join(WEIGHTS)} beside config.json.")


def _kind(config: dict, where: str) -> str:
  """Which library wrote the folder, from config.json."""
  if "architecture" in config:
    return timm_format.KIND
  model_type = config.get("model_type")
  if model_type == "vmoe":
    raise CheckpointError(
        f"init.checkpoint={where} is a folder `vmoe export` wrote (a PyTorch model, "
        "config.json's model_type vmoe): vmoe's commands start from the run it was exported "
        "from (its workdir), not from its export.")
  if model_type:
    return transformers_format.KIND
  raise CheckpointError(
      f"init.checkpoint={where} holds a config.json that names neither a timm architecture "
      "(`architecture`) nor a transformers model (`model_type`): vmoe reads timm's ViT folders "
      "(timm.models.save_for_hf, push_to_hub) and transformers' ViT and DINOv2 folders "
      "(save_pretrained).")


def _open(kind: str, weights: pathlib.Path, config: dict | None, where: str) -> PytorchCheckpoint:
  tensors = state_dicts.read(weights, data=False)
  if kind == timm_format.KIND and not timm_format.is_timm(tensors):
    name = (config or {}).get("architecture") or "a state_dict"
    raise CheckpointError(
        f"init.checkpoint={where} is a timm {name}"
        f"{' folder' if config else ''}, which is not a ViT: its tensors ({_listed(tensors)}) "
        "have no patch_embed.proj and blocks.<i> of timm's VisionTransformer (vit_*, deit*_, "
        "the DINOv2, CLIP and SigLIP ViTs); vmoe starts only from ViTs.")
  _, architecture = _convert(kind, tensors, config, where)
  return PytorchCheckpoint(kind, weights, config, architecture, where)


def _bare(weights: pathlib.Path, where: str) -> PytorchCheckpoint:
  """A state_dict file without config.json: timm's ViT, or a refusal saying what it is."""
  names = state_dicts.read(weights, data=False)
  if timm_format.is_timm(names):
    return _open(timm_format.KIND, weights, None, where)
  if any(".embeddings.patch_embeddings." in f".{n}" for n in names):
    raise CheckpointError(
        f"init.checkpoint={where} is a transformers state_dict ({weights.name}) without its "
        "config.json, which holds what the tensors do not say (hidden_act, layer_norm_eps, "
        "heads): give the folder save_pretrained wrote.")
  raise CheckpointError(
      f"init.checkpoint={where} is a state_dict ({weights.suffix}) that is neither a timm nor a "
      f"transformers ViT: its tensors are {_listed(names)}. vmoe reads timm's VisionTransformer "
      "(patch_embed.proj, blocks.<i>) and, in their folders, transformers' ViT and DINOv2.")


def _folder(folder: pathlib.Path, where: str) -> PytorchCheckpoint:
  """A folder with config.json: timm's or transformers', its weights beside it."""
  config = _config(folder, where)
  kind = _kind(config, where)
  what = (f"a timm {config.get('architecture')} folder" if kind == timm_format.KIND
          else f"a transformers {config.get('model_type')} folder")
  return _open(kind, _weights(folder, where, what), config, where)


def claims(path: str) -> bool:
  """Whether `path` is for `find` to read: a state_dict file, or a folder with config.json or a
  weights file (a run's folders have neither)."""
  p = pathlib.Path(path).expanduser()
  if p.is_file():
    return state_dicts.is_state_dict_file(p)
  return p.is_dir() and any((p / name).is_file() for name in ("config.json", *WEIGHTS))


def find(path: str) -> PytorchCheckpoint | None:
  """The timm or transformers checkpoint at `path`, checked; None when the path is not one of
  these files (another format's, or a run); CheckpointError for one vmoe cannot run."""
  p = pathlib.Path(path).expanduser()
  if p.is_file() and state_dicts.is_state_dict_file(p):
    if p.name in WEIGHTS and (p.parent / "config.json").is_file():
      return _folder(p.parent, path)  # the weights file of a folder: the folder
    return _bare(p, path)
  if not p.is_dir():
    return None
  if (p / "config.json").is_file():
    return _folder(p, path)
  weights = next((p / name for name in WEIGHTS if (p / name).is_file()), None)
  return None if weights is None else _bare(weights, path)
