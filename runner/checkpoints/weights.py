"""Where a stage's parameters come from: a run of this project (runner.checkpoints.checkpoint), or a
released checkpoint, bare parameters under the reference's names without config (stages that read
the model and data from a checkpoint then need `model=` and `data=`): google-research/vmoe's, a ViT
`.npz`, a timm or transformers ViT (pytorch_formats). A path is opened once (`open`), its kind
decided there; the `Opened` value answers every later question."""
from __future__ import annotations

import copy
import dataclasses
import pathlib
import zipfile

import numpy as np

from runner.checkpoints import checkpoint, mapping, pytorch_formats, vmoe_format
from runner.errors import CheckpointError
from runner.models import transfer
from runner.workdirs import workdir_lock

RUN = "vmoe run's checkpoint"
VMOE = "google-research/vmoe checkpoint"
NPZ = "ViT .npz (big_vision / vision_transformer)"
TIMM = pytorch_formats.timm_format.KIND  # "timm ViT"
TRANSFORMERS = pytorch_formats.transformers_format.KIND  # "transformers ViT"
_FORMATS = ("a vmoe run (its workdir, checkpoints/ or a step folder), a google-research/vmoe "
            "checkpoint (<prefix>.index), a ViT .npz (big_vision, vision_transformer), a timm ViT "
            "(.safetensors, .pth, .bin, or the folder timm saves) or a transformers ViT or "
            "DINOv2 folder (config.json and model.safetensors)")


def open(path: str) -> Opened:
  """The checkpoint at `path`, its kind decided: released (VMOE, NPZ, TIMM, TRANSFORMERS) by its
  files, else one of our runs (workdir, checkpoints/ or step folder), located now;
  CheckpointError when neither, or for a released one vmoe cannot run (checked now)."""
  if vmoe_format.is_vmoe_checkpoint(str(path)):
    return Opened(str(path), VMOE)
  if str(path).endswith(".npz") and pathlib.Path(path).expanduser().is_file():
    return Opened(str(path), NPZ)
  if (found := pytorch_formats.find(str(path))) is not None:
    return Opened(str(path), found.kind, source=found)
  try:
    return Opened(str(path), RUN, *checkpoint.locate(path))
  except CheckpointError as e:
    if not pathlib.Path(path).expanduser().is_file():
      raise
    raise CheckpointError(f"{e} A file is none of them: vmoe reads {_FORMATS}.") from None


@dataclasses.dataclass(frozen=True)
class Opened:
  """A checkpoint path and its kind (RUN, VMOE, NPZ, TIMM or TRANSFORMERS); for a RUN, the folder
  of its step folders and the step `path` names (a workdir's: its newest when it was opened); for
  a timm or transformers ViT, the checked `source` (pytorch_formats.PytorchCheckpoint)."""
  path: str
  kind: str
  directory: pathlib.Path | None = None
  step: int | None = None
  source: pytorch_formats.PytorchCheckpoint | None = None

  @property
  def architecture(self):
    """What a timm or transformers checkpoint's files say the model is (model.* keys,
    pytorch_vit.Architecture); None for the other kinds."""
    return None if self.source is None else self.source.architecture

  @property
  def released(self) -> bool:
    return self.kind != RUN

  @property
  def run_folder(self) -> pathlib.Path | None:
    """The workdir of the run (None for a released checkpoint)."""
    if self.released:
      return None
    return self.directory.parent if self.directory.name == "checkpoints" else self.directory

  def unfinished(self) -> str | None:
    """Why the run has no final checkpoint: a vmoe process still holds its workdir, or its stage
    stopped early (no summary.json). A step folder named explicitly is taken as it is; so is a
    released checkpoint."""
    folder = self.run_folder
    if folder is None:
      return None
    if workdir_lock.is_held(folder):
      return (f"the run in {folder} is still being written (a vmoe process holds it); wait for "
              "it to finish")
    named_step = pathlib.Path(self.path).expanduser().name.isdigit()
    if not named_step and not (folder / "summary.json").exists():
      return (f"the run in {folder} did not finish (it has no summary.json): resume it by "
              "rerunning its command, or name one of its step folders "
              "(<workdir>/checkpoints/<step>) to take that checkpoint as it is")
    return None

  def stored_config(self) -> dict | None:
    """The config stored with our checkpoint, None for a released one; read once per process and
    checkpoint, as the checks before launch and the job each ask (a new checkpoint is read anew)."""
    if self.released:
      return None
    key = (str(self.directory), self.step, _modified(self.directory / str(self.step)))
    if key not in _STORED_CONFIGS:
      _STORED_CONFIGS[key] = checkpoint.read_config(self.path, (self.directory, self.step))
    return copy.deepcopy(_STORED_CONFIGS[key])

  def describe(self) -> str:
    """'a google-research/vmoe checkpoint (hidden size 512, ...)' for error messages about a
    released checkpoint, from the shapes alone (it may be gigabytes)."""
    if self.source is not None:
      return self.source.architecture.describe()
    try:
      flat = vmoe_format.shapes(self.path) if self.kind == VMOE else _npz_shapes(self.path)
    except (CheckpointError, OSError, ValueError, zipfile.BadZipFile):
      return f"a {self.kind}"
    hint = mapping.model_hint(flat)
    listed = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in hint.items() if v is not None)
    return f"a {self.kind}" + (f" ({listed})" if listed else "")

  def load(self, *, ensemble_size: int = 1) -> tuple[dict, dict, int]:
    """(host NumPy parameters under our names, stored config, step); a released checkpoint gives
    {} and step 0, an E³ router stored (D, M, E/M) checked on `ensemble_size`, read as (D, E)."""
    if not self.released:
      params, _, step = checkpoint.load_params(self.path, (self.directory, self.step),
                                               with_config=False)
      return params, self.stored_config(), step
    if self.source is not None:  # mapped when it was opened: only reading can fail now
      return transfer.unflatten(self.source.load()), {}, 0
    flat = vmoe_format.read(self.path) if self.kind == VMOE else _read_npz(self.path)
    try:
      ours = mapping.to_ours(flat, ensemble_size=ensemble_size)
    except CheckpointError as e:
      raise CheckpointError(f"init.checkpoint={self.path} ({self.kind}): {e}") from None
    return transfer.unflatten(ours), {}, 0


def load(path: str, *, ensemble_size: int = 1) -> tuple[dict, dict, int]:
  """`Opened.load` of the checkpoint at `path`, for a caller that has only the path."""
  return open(path).load(ensemble_size=ensemble_size)


class Checkpoints:
  """The checkpoints one command names, each path opened once (the checks before launch, or the job,
  ask about one path again and again): runner.config's CheckpointReader."""

  def __init__(self):
    self._opened: dict[str, Opened | CheckpointError] = {}

  def open(self, path: str) -> Opened:
    """The path opened; its CheckpointError when it holds no checkpoint, each time it is asked
    for (the checks before launch pass over it: the task reports it)."""
    key = str(path)
    if key not in self._opened:
      try:
        self._opened[key] = open(path)
      except CheckpointError as e:
        self._opened[key] = e
    opened = self._opened[key]
    if isinstance(opened, CheckpointError):
      raise opened.with_traceback(None)
    return opened

  def stored_config(self, path: str) -> dict | None:
    return self.open(path).stored_config()

  def describe(self, path: str) -> str:
    return self.open(path).describe()

  def unfinished(self, path: str) -> str | None:
    return self.open(path).unfinished()

  def architecture(self, path: str):
    """What a timm or transformers checkpoint says its ViT is (runner/config/relations.py checks
    the model against it, before anything runs); None for the other kinds. Its CheckpointError
    for a timm or transformers file vmoe cannot run; another kind's is the stage's to report."""
    try:
      return self.open(path).architecture
    except CheckpointError:
      if pytorch_formats.claims(path):
        raise
      return None


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
