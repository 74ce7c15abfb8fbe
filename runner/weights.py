"""Where a stage's parameters come from: a run of this project, or a released checkpoint.

Our runs are Orbax checkpoints with their config (runner.checkpoint, the one door for them).
Released checkpoints — google-research/vmoe's `<prefix>.index` + `<prefix>.data-*` files and
big_vision / vision_transformer ViT `.npz` files — hold bare parameters under the reference's
names; runner.interop reads and renames them. They carry no config, so the stages that read the
model and data from a checkpoint need `model=` and `data=` for them.
"""
from __future__ import annotations

import copy
import pathlib
import zipfile

import numpy as np

from runner import checkpoint, workdir_lock
from runner.checkpoint import CheckpointError
from runner.interop import mapping, vmoe_format
from runner.models import transfer

VMOE = "google-research/vmoe checkpoint"
NPZ = "ViT .npz (big_vision / vision_transformer)"


def released_kind(path: str | None) -> str | None:
  """VMOE or NPZ for a released checkpoint, None for anything else (our runs included)."""
  if not path:
    return None
  if vmoe_format.is_vmoe_checkpoint(str(path)):
    return VMOE
  if str(path).endswith(".npz") and pathlib.Path(path).expanduser().is_file():
    return NPZ
  return None


def check(path: str) -> None:
  """Fails (CheckpointError) unless `path` is one of our checkpoints or a released one."""
  if released_kind(path) is None:
    checkpoint.locate(path)


def run_folder(path: str) -> pathlib.Path | None:
  """The workdir of the run whose checkpoint `path` names (the workdir, its checkpoints/ folder
  or a step folder); None for a released checkpoint."""
  if released_kind(path) is not None:
    return None
  directory, _ = checkpoint.locate(path)
  return directory.parent if directory.name == "checkpoints" else directory


def unfinished(path: str) -> str | None:
  """Why the run at `path` has no final checkpoint to take: it is still being written (a vmoe
  process holds its workdir), or its stage stopped before the end (no summary.json). A step
  folder named explicitly is taken as it is; so is a released checkpoint."""
  folder = run_folder(path)
  if folder is None:
    return None
  if workdir_lock.is_held(folder):
    return (f"the run in {folder} is still being written (a vmoe process holds it); wait for it "
            "to finish")
  named_step = pathlib.Path(path).expanduser().name.isdigit()
  if not named_step and not (folder / "summary.json").exists():
    return (f"the run in {folder} did not finish (it has no summary.json): resume it by rerunning "
            "its command, or name one of its step folders (<workdir>/checkpoints/<step>) to take "
            "that checkpoint as it is")
  return None


def stored_config(path: str) -> dict | None:
  """The config stored with one of our checkpoints; None for a released checkpoint (it has none).

  Read once per process and checkpoint: checking a command line, resolving its config and
  starting from the checkpoint all ask (a new checkpoint under `path` is read anew)."""
  if released_kind(path) is not None:
    return None
  directory, step = checkpoint.locate(path)
  key = (str(directory), step, _modified(directory / str(step)))
  if key not in _STORED_CONFIGS:
    _STORED_CONFIGS[key] = checkpoint.read_config(path)
  return copy.deepcopy(_STORED_CONFIGS[key])


_STORED_CONFIGS: dict[tuple, dict] = {}


def _modified(path) -> int:
  try:
    return pathlib.Path(path).stat().st_mtime_ns
  except OSError:
    return 0


def _read_npz(path: str) -> dict[str, np.ndarray]:
  """Every array of a `.npz`, read one at a time (np.load is lazy per array)."""
  try:
    with np.load(pathlib.Path(path).expanduser(), allow_pickle=False) as f:
      return {name: f[name] for name in f.files}
  except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
    raise CheckpointError(f"init.checkpoint={path} cannot be read as a .npz file ({e}); a "
                          "ViT checkpoint of big_vision or vision_transformer is a NumPy .npz "
                          "archive of named arrays.") from None


def read_released(path: str) -> dict[str, np.ndarray]:
  """The reference-named flat parameters of a released checkpoint."""
  if released_kind(path) == VMOE:
    return vmoe_format.read(str(path))
  return _read_npz(path)


def _npz_shapes(path: str) -> dict[str, np.ndarray]:
  """Every array's shape and dtype from the .npz members' headers (no data read)."""
  out = {}
  with zipfile.ZipFile(pathlib.Path(path).expanduser()) as archive:
    for member in archive.namelist():
      with archive.open(member) as f:
        version = np.lib.format.read_magic(f)
        shape, _, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                           else np.lib.format.read_array_header_2_0(f))
      out[member.removesuffix(".npy")] = np.broadcast_to(np.zeros((), dtype), shape)
  return out


def describe(path: str) -> str:
  """'a google-research/vmoe checkpoint (hidden size 512, ...)' for error messages, from the
  shapes alone (a released checkpoint may be gigabytes)."""
  try:
    flat = vmoe_format.shapes(path) if released_kind(path) == VMOE else _npz_shapes(path)
  except (CheckpointError, OSError, ValueError, zipfile.BadZipFile):
    return f"a {released_kind(path)}"
  hint = mapping.model_hint(flat)
  listed = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in hint.items() if v is not None)
  return f"a {released_kind(path)}" + (f" ({listed})" if listed else "")


def load(path: str, *, ensemble_size: int = 1) -> tuple[dict, dict, int]:
  """(parameters as host NumPy arrays under our names, stored config, step).

  A released checkpoint gives an empty config and step 0; a partitioned-ensemble (E³) router
  stored as (D, M, E/M) is checked against `ensemble_size` and read as (D, E).
  """
  kind = released_kind(path)
  if kind is None:
    params, _, step = checkpoint.load_params(path, with_config=False)
    return params, stored_config(path), step
  flat = read_released(path)
  try:
    ours = mapping.to_ours(flat, ensemble_size=ensemble_size)
  except CheckpointError as e:
    raise CheckpointError(f"init.checkpoint={path} ({kind}): {e}") from None
  del flat
  return transfer.unflatten(ours), {}, 0
