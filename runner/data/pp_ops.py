"""Preprocessing ops addressed by strings: "decode(3)|resize(32)|flip_lr|value_range(-1,1)". Ops
read and write `example["image"]` unless told otherwise (grammar and table of ops:
runner/config/preprocessing.py). Random ops are stateless, drawing from `example["_rng"]` (run seed,
position in the stream): a resumed run sees exactly an uninterrupted one's augmentations."""
from __future__ import annotations

from typing import Callable

from runner.config import components
# PreprocessError is the grammar's; the ops' callers catch it from here too.
from runner.config.preprocessing import OPS, PreprocessError, build  # noqa: F401
from runner.data.tensorflow_on_use import tf

Example = dict
Op = Callable[[Example], Example]
KIND = components.Kind(OPS)  # no keys: an op's arguments are written in the spec


def register(name: str):
  """Marks `factory(*args, **kwargs) -> op` as the op `name` of a spec."""
  def wrap(factory: Callable[..., Op]):
    components.register(KIND, name, factory)
    return factory
  return wrap


def registered_ops() -> list[str]:
  return sorted(OPS.names())


def parse(spec: str) -> Op:
  """Builds the function for a `|`-separated spec; errors name the op and the valid ones."""
  ops = build(spec)

  def apply(example: Example) -> Example:
    for op in ops:
      example = op(example)
    return example
  return apply


def _next_seed(example: Example) -> tf.Tensor:
  """Splits the example's stateless seed: one half for this op, one half kept for the next."""
  seeds = tf.random.experimental.stateless_split(example["_rng"], num=2)
  example["_rng"] = seeds[0]
  return seeds[1]


def _size(size) -> tuple[int, int]:
  return (size, size) if isinstance(size, int) else tuple(size)


def _check_crop(image: tf.Tensor, h: int, w: int) -> None:
  """A crop larger than an image of known size fails as the pipeline is built, not as it runs."""
  if None not in image.shape[:2] and (image.shape[0] < h or image.shape[1] < w):
    raise ValueError(f"a {h}x{w} crop of a {image.shape[0]}x{image.shape[1]} image")


@register("decode")
def get_decode(channels: int = 3, key: str = "image"):
  """Encoded bytes -> uint8 image with `channels` channels (grey images are repeated to RGB)."""
  def op(example):
    image = example[key]
    if image.dtype == tf.string:
      image = tf.io.decode_image(image, channels=0, expand_animations=False)
    grey = tf.shape(image)[-1] <= 2  # grey (1), grey+alpha (2), RGB (3) or RGBA (4): alpha dropped
    if channels == 3:
      image = tf.cond(grey, lambda: tf.image.grayscale_to_rgb(image[..., :1]),
                      lambda: image[..., :3])
    elif channels == 1:
      image = tf.cond(grey, lambda: image[..., :1],
                      lambda: tf.image.rgb_to_grayscale(image[..., :3]))
    image.set_shape([None, None, channels])
    example[key] = image
    return example
  return op


@register("resize")
def get_resize(size, method: str = "bilinear", key: str = "image"):
  """Resizes to (size, size) or (h, w), ignoring the aspect ratio."""
  def op(example):
    dtype = example[key].dtype
    image = tf.image.resize(example[key], _size(size), method=method)
    if dtype == tf.uint8:
      image = tf.cast(tf.round(tf.clip_by_value(image, 0, 255)), dtype)
    example[key] = image
    return example
  return op


@register("resize_small")
def get_resize_small(smaller_size: int, method: str = "area", key: str = "image"):
  """Resizes so that the smaller side is `smaller_size`, keeping the aspect ratio."""
  def op(example):
    image = example[key]
    h, w = tf.shape(image)[0], tf.shape(image)[1]
    ratio = tf.cast(smaller_size, tf.float32) / tf.cast(tf.minimum(h, w), tf.float32)
    new = tf.cast(tf.round(tf.cast(tf.stack([h, w]), tf.float32) * ratio), tf.int32)
    example[key] = tf.cast(tf.image.resize(image, new, method=method), image.dtype)
    return example
  return op


@register("central_crop")
def get_central_crop(size, key: str = "image"):
  def op(example):
    h, w = _size(size)
    image = example[key]
    _check_crop(image, h, w)
    top = (tf.shape(image)[0] - h) // 2
    left = (tf.shape(image)[1] - w) // 2
    example[key] = tf.image.crop_to_bounding_box(image, top, left, h, w)
    return example
  return op


@register("random_crop")
def get_random_crop(size, key: str = "image"):
  def op(example):
    h, w = _size(size)
    image = example[key]
    _check_crop(image, h, w)
    example[key] = tf.image.stateless_random_crop(
        image, [h, w, tf.shape(image)[-1]], seed=_next_seed(example))
    return example
  return op


@register("pad")
def get_pad(pad: int, key: str = "image"):
  """Zero-pads every side by `pad` pixels (the usual CIFAR 'pad(4)|random_crop(32)')."""
  def op(example):
    example[key] = tf.pad(example[key], [[pad, pad], [pad, pad], [0, 0]])
    return example
  return op


@register("inception_crop")
def get_inception_crop(size=None, area_min: int = 5, area_max: int = 100, key: str = "image"):
  """Random crop of 5%-100% of the area and 3/4-4/3 aspect ratio, then resize (ViT/BiT style)."""
  def op(example):
    image = example[key]
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image), tf.zeros([0, 0, 4], tf.float32), seed=_next_seed(example),
        area_range=(area_min / 100, area_max / 100), min_object_covered=0,
        use_image_if_no_bounding_boxes=True)
    crop = tf.slice(image, begin, crop_size)
    crop.set_shape([None, None, image.shape[-1]])
    if size is not None:
      resized = tf.image.resize(crop, _size(size))
      if image.dtype == tf.uint8:
        resized = tf.round(tf.clip_by_value(resized, 0, 255))
      crop = tf.cast(resized, image.dtype)
    example[key] = crop
    return example
  return op


@register("flip_lr")
def get_flip_lr(key: str = "image"):
  def op(example):
    example[key] = tf.image.stateless_random_flip_left_right(example[key], seed=_next_seed(example))
    return example
  return op


@register("value_range")
def get_value_range(vmin: float = -1.0, vmax: float = 1.0, in_min: float = 0.0,
                    in_max: float = 255.0, key: str = "image"):
  """Maps [in_min, in_max] linearly onto [vmin, vmax] as float32."""
  def op(example):
    image = tf.cast(example[key], tf.float32)
    example[key] = vmin + (image - in_min) * (vmax - vmin) / (in_max - in_min)
    return example
  return op


@register("onehot")
def get_onehot(num_classes: int, key: str = "label", key_result: str = "labels",
               on: float = 1.0, off: float = 0.0):
  """Integer label -> one-hot; a list of labels (multi-label data) -> multi-hot."""
  def op(example):
    label = example[key]
    hot = tf.one_hot(label, num_classes, on_value=1.0, off_value=0.0)
    if label.shape.rank == 1:  # multi-label: at most 1 per class, zeros for no label
      hot = tf.minimum(tf.reduce_sum(hot, axis=0), 1.0)
    example[key_result] = off + hot * (on - off)
    return example
  return op


@register("keep")
def get_keep(*keys: str):
  def op(example):
    return {k: v for k, v in example.items() if k in keys or k.startswith("_")}
  return op
