"""The exported model checked against vmoe: the same images through both, probabilities compared.

PyTorch runs in a child process of its own that never imports JAX, as a user's would, so the
check covers what users load: the folder's own `modeling_vmoe.py` and `model.safetensors`, not
this package's copy. Without PyTorch in this environment the check is skipped, and the summary
says so (`pip install -e '.[torch]'` in the vmoe checkout adds it)."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

TOLERANCE = 1e-4  # the largest difference of a probability allowed in float32

# Run with: python -c SCRIPT <export folder> <batches.npy> <probabilities.npy>; the batches are
# (n, B, C, H, W), each fed to the model as one batch (its routing groups are the batch's).
SCRIPT = """
import importlib.util, pathlib, sys
import numpy, torch
folder, images, out = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("modeling_vmoe", pathlib.Path(folder) / "modeling_vmoe.py")
modeling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(modeling)
model = modeling.load(folder)
with torch.no_grad():
  probs = [model.predict_proba(torch.from_numpy(batch)).numpy() for batch in numpy.load(images)]
assert "jax" not in sys.modules and "flax" not in sys.modules, "the exported model imported JAX"
numpy.save(out, numpy.stack(probs))
"""


def torch_installed() -> bool:
  return all(importlib.util.find_spec(m) is not None for m in ("torch", "safetensors"))


def torch_probabilities(folder: str | pathlib.Path, images: np.ndarray) -> np.ndarray:
  """The exported model's `predict_proba` of float32 NCHW `images`, in a process without JAX:
  one batch (B, C, H, W) -> (B, classes), or batches (n, B, C, H, W) -> (n, B, classes)."""
  batches = images[None] if images.ndim == 4 else images
  with tempfile.TemporaryDirectory() as tmp:
    inputs, outputs = pathlib.Path(tmp) / "images.npy", pathlib.Path(tmp) / "probs.npy"
    np.save(inputs, np.ascontiguousarray(batches, np.float32))
    # -B: importing the folder's modeling_vmoe.py writes no __pycache__ into the user's folder.
    done = subprocess.run([sys.executable, "-B", "-c", SCRIPT, str(folder), str(inputs),
                           str(outputs)], capture_output=True, text=True, check=False)
    if done.returncode:
      raise RuntimeError(f"the exported model failed in PyTorch:\n{done.stderr[-4000:]}")
    probs = np.load(outputs)
  return probs[0] if images.ndim == 4 else probs


def check_images(image_size: int, channels: int, input_range: tuple[float, float], count: int,
                 seed: int = 0) -> np.ndarray:
  """`count` NHWC images uniform over the inputs' range: every token of them routes somewhere,
  and a batch of several routing groups lets tokens compete for the experts' buffers."""
  shape = (count, image_size, image_size, channels)
  return np.random.default_rng(seed).uniform(*input_range, shape).astype(np.float32)
