"""Input data: embedded offline TFDS datasets, any prepared TFDS dataset, image folders, files of
image-caption pairs; and tokenizers for the captions. Importing this package quiets TensorFlow
without importing it: TensorFlow loads when data is first read (runner/data/tensorflow_on_use.py),
and then never takes GPU/TPU memory that JAX needs."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# TensorFlow imports Keras 3 as it loads (and scikit-learn with it), about 1 s of every command
# that reads data; vmoe uses no Keras. Asking for the legacy Keras package (tf_keras, not among
# vmoe's dependencies) makes TensorFlow skip that import when it is absent (tf.keras would then
# fail to import; setting the variable yourself keeps your choice: docs/speed.md).
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import logging  # noqa: E402

import tensorflow_datasets as tfds  # noqa: E402  (it imports TensorFlow when it first needs it)

logging.getLogger("absl").setLevel(logging.WARNING)
tfds.disable_progress_bar()

from runner.data.pipeline import TextSpec, eval_batches, image_shape, train_batches  # noqa: E402
from runner.data.sources import DataError, Source, known_names, open_source  # noqa: E402
from runner.data.pp_ops import PreprocessError  # noqa: E402
from runner.data.splits import open_data  # noqa: E402
from runner.data import corruptions  # noqa: E402,F401  (registers the corrupt(name, severity) op)

__all__ = ["DataError", "PreprocessError", "Source", "TextSpec", "eval_batches", "image_shape",
           "known_names", "open_data", "open_source", "train_batches"]
