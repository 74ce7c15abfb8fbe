"""PyTorch state_dicts on disk, as NumPy arrays under the names the file gives them.

`.safetensors` is read here, without PyTorch: an 8-byte header length, a JSON header (each tensor's
dtype, shape and byte range), then the raw little-endian data. Reading the header alone gives every
shape (a checkpoint is checked against the model before gigabytes are read) and finds a truncated
file before any use; the arrays are memory-mapped, bfloat16 ones through ml_dtypes (which JAX
ships), which the `safetensors` package's NumPy reader lacks. `.pth`, `.pt` and `.bin` files are
pickles only PyTorch reads: they need torch installed, and say so when it is not."""
from __future__ import annotations

import json
import math
import pathlib
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from runner.errors import CheckpointError

SAFETENSORS = ".safetensors"
PICKLED = (".pth", ".pt", ".bin")
SUFFIXES = (SAFETENSORS, *PICKLED)
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}
# Checkpoint files wrap the state_dict in one of these entries (a training run's save).
_WRAPPERS = ("state_dict", "model", "module")


def is_state_dict_file(path: str | pathlib.Path) -> bool:
  return pathlib.Path(path).suffix in SUFFIXES


def _stand_in(dtype, shape) -> np.ndarray:
  """An array of `shape` that holds no data (a broadcast scalar): what a shape check needs."""
  return np.broadcast_to(np.zeros((), dtype), tuple(shape))


def _header(path: pathlib.Path) -> tuple[int, dict]:
  """(the data's offset in the file, the tensors' header entries), every entry checked."""
  size = path.stat().st_size
  with path.open("rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"it holds {size} bytes, fewer than a safetensors header's 8")
    (length,) = struct.unpack("<Q", head)
    if length > size - 8:
      raise ValueError(f"its header claims {length} bytes but the file holds {size}: it is "
                       "truncated, or not a safetensors file")
    try:
      header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"its header is not JSON ({e}): not a safetensors file") from None
  if not isinstance(header, dict):
    raise ValueError("its header is not a JSON object: not a safetensors file")
  header.pop("__metadata__", None)
  data = size - 8 - length
  for name, entry in header.items():
    dtype = entry.get("dtype") if isinstance(entry, dict) else None
    if dtype not in _DTYPES:
      raise ValueError(f"tensor {name!r} has the dtype {dtype!r}, which vmoe does not read")
    begin, end = entry["data_offsets"]
    expected = math.prod(entry["shape"]) * np.dtype(_DTYPES[dtype]).itemsize
    if end - begin != expected:
      raise ValueError(f"tensor {name!r}'s {end - begin} bytes do not fit its shape "
                       f"{tuple(entry['shape'])} of {dtype}")
    if end > data:
      raise ValueError(f"tensor {name!r} ends at byte {end} of the data, but the file holds "
                       f"{data} bytes of data: it is truncated (an interrupted download or copy?)")
  return 8 + length, header


def _safetensors(path: pathlib.Path, *, data: bool) -> dict[str, np.ndarray]:
  try:
    offset, header = _header(path)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"init.checkpoint={path} cannot be read as a .safetensors file: "
                          f"{e}.") from None
  out = {}
  for name, entry in header.items():
    dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["shape"])
    if not data:  # float32 stand-ins: a shape check converts them without a copy
      out[name] = _stand_in(np.float32, shape)
    elif math.prod(shape) == 0:
      out[name] = np.zeros(shape, dtype)
    else:
      out[name] = np.memmap(path, dtype=dtype, mode="r",
                            offset=offset + entry["data_offsets"][0], shape=shape)
  return out


def _unwrapped(loaded) -> Mapping:
  """The state_dict of a torch.load result: itself, or the entry a training save put it under;
  a DistributedDataParallel's `module.` prefix removed."""
  if isinstance(loaded, Mapping):
    loaded = next((loaded[k] for k in _WRAPPERS if isinstance(loaded.get(k), Mapping)), loaded)
  if not isinstance(loaded, Mapping):
    raise ValueError(f"it holds a {type(loaded).__name__}, not a state_dict (a dict of tensors)")
  if loaded and all(str(k).startswith("module.") for k in loaded):
    loaded = {str(k)[len("module."):]: v for k, v in loaded.items()}
  return loaded


def _pickled(path: pathlib.Path, *, data: bool) -> dict[str, np.ndarray]:
  try:
    import torch  # only these pickles need PyTorch; it is not one of vmoe's dependencies
  except ImportError:
    raise CheckpointError(
        f"init.checkpoint={path} is a PyTorch pickle ({path.suffix}), which only PyTorch can "
        "read, and torch is not installed here: install it (pip install torch), or give the "
        "same weights as a .safetensors file (timm and transformers save them so; "
        "safetensors.torch.save_file(torch.load(path), 'model.safetensors') converts one), "
        "which vmoe reads without PyTorch.") from None
  try:
    try:  # memory-mapped: the tensors are not all read at once (a zip-format save)
      loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a legacy (non-zip) save cannot be memory-mapped
      loaded = torch.load(path, map_location="cpu", weights_only=True)
    state = _unwrapped(loaded)
  except Exception as e:  # torch raises many types for a file it cannot unpickle
    raise CheckpointError(f"init.checkpoint={path} cannot be read by torch.load as a state_dict: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}.") from None
  out = {}
  for name, value in state.items():
    if not isinstance(value, torch.Tensor):
      continue  # a step count or other entry saved beside the tensors
    if not data:
      out[str(name)] = _stand_in(np.float32, value.shape)
    else:  # float32 whatever the stored precision: NumPy has no bfloat16 tensor interchange
      out[str(name)] = value.detach().to(torch.float32).numpy()
  return out


def read(path: str | pathlib.Path, *, data: bool = True) -> dict[str, np.ndarray]:
  """Every tensor of a state_dict file by name; `data=False`: shape-only stand-ins (the
  .safetensors header alone is read). CheckpointError names the file and what is wrong."""
  path = pathlib.Path(path).expanduser()
  if path.suffix == SAFETENSORS:
    return _safetensors(path, data=data)
  if path.suffix in PICKLED:
    return _pickled(path, data=data)
  raise CheckpointError(f"init.checkpoint={path}: {path.suffix or 'a file without a suffix'} is "
                        f"not a state_dict file vmoe reads ({', '.join(SUFFIXES)}).")
