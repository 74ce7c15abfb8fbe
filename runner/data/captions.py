"""Captioned versions of the embedded digit sets, for contrastive image-text training offline: a
caption is the class name in one of TRAIN_TEMPLATES, picked by the example's index. Trained on such
captions (only the label), a model learns a classifier through a text tower, which zero-shot
evaluation with HELD_OUT_TEMPLATES (unseen in training) measures, not image-text understanding."""
from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

from runner.config import components
from runner.data.embedded import KIND, Mnist5k, UciDigits

CLASS_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

TRAIN_TEMPLATES = (
    "a photo of the digit {}.",
    "a handwritten {}.",
    "the number {}, written by hand.",
    "a scan of a handwritten digit {}.",
    "a small picture of the number {}.",
    "{}, a handwritten digit.",
    "an image of a {}.",
    "a blurry {}.",
)

HELD_OUT_TEMPLATES = (  # prompts for zero-shot classification only: no training caption uses them
    "a picture of the number {}.",
    "a digit {} drawn by a person.",
    "this is a {}.",
    "a low resolution image of the digit {}.",
)

_TEMPLATE_SEED = 20_230_113  # any fixed value: it picks each example's template


def caption(label: int, index: int) -> str:
  """The training caption of example `index` (its place in the source arrays), of class `label`."""
  template = np.random.default_rng([_TEMPLATE_SEED, index]).integers(len(TRAIN_TEMPLATES))
  return TRAIN_TEMPLATES[template].format(CLASS_NAMES[label])


class _Captioned:
  """Adds the `caption` feature to a digit builder and names its classes."""

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=f"{self.DESCRIPTION} With one template caption per example.",
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=self.IMAGE_SHAPE),
            "label": tfds.features.ClassLabel(names=CLASS_NAMES),
            "caption": tfds.features.Text(),
        }),
        supervised_keys=("image", "label"),
    )

  def _generate_examples(self, images, labels, indices):
    for i in indices:
      label = int(labels[i])
      yield int(i), {"image": images[i], "label": label, "caption": caption(label, int(i))}


class Mnist5kCaptions(_Captioned, Mnist5k):
  """mnist5k with template captions."""


class UciDigitsCaptions(_Captioned, UciDigits):
  """uci_digits with template captions."""


components.register(KIND, "mnist5k_captions", Mnist5kCaptions)
components.register(KIND, "uci_digits_captions", UciDigitsCaptions)
