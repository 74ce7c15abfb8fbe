"""TensorFlow, imported when a command first reads data rather than when `vmoe` starts: the data
ops' and datasets' names register without it, so a refused command answers seconds sooner
(docs/speed.md). `tf`'s first attribute read imports TensorFlow and hides the accelerators from
it (tf.data must not take GPU/TPU memory that JAX needs); `open_source` calls `tensorflow()` once a
dataset is found, before TFDS reads with TensorFlow on its own."""
from __future__ import annotations

import functools
import importlib
import types


@functools.cache
def tensorflow() -> types.ModuleType:
  module = importlib.import_module("tensorflow")
  try:
    module.config.set_visible_devices([], "GPU")
  except RuntimeError:  # a plug-in ran TensorFlow first: its devices are set and stay so
    pass
  return module


class _OnUse(types.ModuleType):
  def __getattr__(self, name: str):
    return getattr(tensorflow(), name)


tf = _OnUse("tensorflow")
