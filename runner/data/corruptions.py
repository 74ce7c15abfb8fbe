"""CIFAR-10-C image corruptions as a preprocessing op: "decode(3)|corrupt('contrast', 3)|...".
Computed in the input pipeline rather than shipped as the fixed .npy files of Hendrycks & Dietterich
(2019), they apply to any dataset, image size and evaluation. Severity tables are those of the
reference script github.com/hendrycks/robustness, ImageNet-C/create_c/make_cifar_c.py (the CIFAR
variant); where it calls PIL, skimage or OpenCV, each function says its TensorFlow equivalent;
docs/evaluation.md lists what is implemented. Random corruptions draw from the example's stateless
seed (`_next_seed`), as pp_ops' random augmentations: one `_rng`, one image."""
from __future__ import annotations

import numpy as np

from runner.config import components, preprocessing
from runner.data.pp_ops import PreprocessError, _next_seed, register
from runner.data.tensorflow_on_use import tf

_PARAMS = {  # severity 1..5 -> parameter, copied from make_cifar_c.py (its function of that name)
    "gaussian_noise": (0.04, 0.06, .08, .09, .10),  # std of additive noise on [0, 1]
    "shot_noise": (500, 250, 100, 75, 50),  # photons per unit intensity: Poisson(x * c) / c
    "impulse_noise": (.01, .02, .03, .05, .07),  # fraction of values set to 0 or 1 (salt & pepper)
    "speckle_noise": (.06, .1, .12, .16, .2),  # std of multiplicative noise: x + x * N(0, c)
    "gaussian_blur": (.4, .6, 0.7, .8, 1),  # sigma in pixels (skimage.filters.gaussian)
    # (disk radius, sigma of its anti-aliasing blur), both in pixels
    "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)),
    "contrast": (.75, .5, .4, .3, 0.15),  # deviations from the per-channel mean are scaled by c
    "brightness": (.05, .1, .15, .2, .3),  # added to V in HSV
    "saturate": ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)),  # S -> S * c0 + c1 in HSV
    "jpeg_compression": (80, 65, 58, 50, 40),  # JPEG quality
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),  # side of the downsampled image / original side
}
CORRUPTIONS = tuple(_PARAMS)
# These consume a seed from `_rng`; the others are deterministic functions of the image.
RANDOM_CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise")
SEVERITIES = (1, 2, 3, 4, 5)
_HSV_CORRUPTIONS = ("brightness", "saturate")


def _gaussian_noise(x, c, seed):
  return x + c * tf.random.stateless_normal(tf.shape(x), seed)


def _shot_noise(x, c, seed):
  return tf.random.stateless_poisson(tf.shape(x), seed, lam=x * c, dtype=tf.float32) / c


def _impulse_noise(x, c, seed):
  """skimage's random_noise(mode='s&p'): each value independently, with probability c, becomes 0
  or 1 with equal odds (one uniform draw decides both)."""
  u = tf.random.stateless_uniform(tf.shape(x), seed)
  return tf.where(u < c / 2, 0.0, tf.where(u < c, 1.0, x))


def _speckle_noise(x, c, seed):
  return x + x * c * tf.random.stateless_normal(tf.shape(x), seed)


def _padded(x, pad: int, axis: int, mode: str):
  """Pads one spatial axis by gathering: 'edge' repeats the border pixel (scipy's 'nearest'),
  'reflect' mirrors without repeating it (OpenCV's BORDER_REFLECT_101); any image size works."""
  n = tf.shape(x)[axis]
  i = tf.range(-pad, n + pad)
  if mode == "edge":
    i = tf.clip_by_value(i, 0, n - 1)
  else:
    period = tf.maximum(2 * (n - 1), 1)
    i = tf.math.floormod(i, period)
    i = tf.minimum(tf.where(i >= n, period - i, i), n - 1)
  return tf.gather(x, i, axis=axis)


def _filter(x, kernel: np.ndarray, mode: str):
  """Correlates each channel of (H, W, C) `x` with the 2-D `kernel` (odd sides), same size out."""
  kh, kw = kernel.shape
  y = _padded(_padded(x, kh // 2, 0, mode), kw // 2, 1, mode)[None]
  channels = x.shape[-1] or 3
  k = tf.constant(np.tile(kernel[:, :, None, None], (1, 1, channels, 1)), tf.float32)
  return tf.nn.depthwise_conv2d(y, k, strides=[1, 1, 1, 1], padding="VALID")[0]


def _gaussian_kernel_1d(sigma: float, truncate: float = 4.0) -> np.ndarray:
  """scipy.ndimage.gaussian_filter1d's weights (what skimage.filters.gaussian calls)."""
  radius = int(truncate * sigma + 0.5)
  t = np.arange(-radius, radius + 1, dtype=np.float64)
  w = np.exp(-0.5 * t ** 2 / sigma ** 2)
  return w / w.sum()


def _gaussian_blur(x, c, seed):
  """skimage.filters.gaussian(sigma=c) with its defaults (truncate 4, mode 'nearest'), separable."""
  k = _gaussian_kernel_1d(c)
  return _filter(_filter(x, k[:, None], "edge"), k[None, :], "edge")


def _disk_kernel(radius: float, alias_blur: float) -> np.ndarray:
  """make_cifar_c.disk: a normalised disk on a 17x17 grid, smoothed by cv2.GaussianBlur with a
  3x3 kernel of sigma `alias_blur`; cropped to its non-zero support (5x5 at most here)."""
  t = np.arange(-8, 9)
  xx, yy = np.meshgrid(t, t)
  disk = (xx ** 2 + yy ** 2 <= radius ** 2).astype(np.float64)
  disk /= disk.sum()
  g = np.exp(-np.arange(-1, 2) ** 2 / (2 * alias_blur ** 2))
  g /= g.sum()
  k = np.apply_along_axis(np.convolve, 0, disk, g, mode="same")
  k = np.apply_along_axis(np.convolve, 1, k, g, mode="same")
  rows, cols = np.nonzero(k.any(axis=1))[0], np.nonzero(k.any(axis=0))[0]
  return k[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]


def _defocus_blur(x, c, seed):
  """cv2.filter2D(x, -1, disk(*c)) per channel; filter2D's default border is BORDER_REFLECT_101."""
  return _filter(x, _disk_kernel(*c), "reflect")


def _contrast(x, c, seed):
  mean = tf.reduce_mean(x, axis=[0, 1], keepdims=True)  # per channel, as the reference
  return (x - mean) * c + mean


def _brightness(x, c, seed):
  h, s, v = tf.unstack(tf.image.rgb_to_hsv(x), axis=-1)
  return tf.image.hsv_to_rgb(tf.stack([h, s, tf.clip_by_value(v + c, 0.0, 1.0)], axis=-1))


def _saturate(x, c, seed):
  h, s, v = tf.unstack(tf.image.rgb_to_hsv(x), axis=-1)
  s = tf.clip_by_value(s * c[0] + c[1], 0.0, 1.0)
  return tf.image.hsv_to_rgb(tf.stack([h, s, v], axis=-1))


def _jpeg_compression(x, c, seed):
  """PIL's save(quality=c) round trip. Both encoders are libjpeg's with its standard tables and
  4:2:0 chroma; PIL decodes with the accurate integer IDCT, TF by default with the fast one (off by
  up to 4 levels), so the decode asks for the accurate one: the result is PIL's exactly."""
  image = tf.cast(tf.round(tf.clip_by_value(x, 0.0, 1.0) * 255.0), tf.uint8)
  encoded = tf.io.encode_jpeg(image, quality=c)
  return tf.cast(tf.io.decode_jpeg(encoded, dct_method="INTEGER_ACCURATE"), tf.float32) / 255.0


def _box_resize_matrix(n_in, n_out):
  """PIL's Image.resize(..., BOX) along one axis as an (n_out, n_in) matrix (precompute_coeffs in
  Pillow's Resample.c, same float64 arithmetic): output pixel o is the plain mean of the input
  pixels whose centres lie in its footprint, (o + 0.5) * scale -+ scale / 2 (right end included),
  scale = n_in / n_out; upsampling (scale < 1) thus copies the one covering pixel. Unlike an area
  resize, a pixel straddling two footprints counts fully in one of them, not in part in both."""
  scale = tf.cast(n_in, tf.float64) / tf.cast(n_out, tf.float64)
  filterscale = tf.maximum(scale, 1.0)
  support = 0.5 * filterscale
  center = (tf.cast(tf.range(n_out), tf.float64)[:, None] + 0.5) * scale
  i = tf.cast(tf.range(n_in), tf.float64)[None, :]
  t = (i - center + 0.5) * (1.0 / filterscale)
  inside = ((t > -0.5) & (t <= 0.5) & (i >= tf.floor(center - support + 0.5))
            & (i < tf.floor(center + support + 0.5)))
  w = tf.cast(inside, tf.float64)
  return tf.cast(w / tf.reduce_sum(w, axis=1, keepdims=True), tf.float32)


def _box_resize(x, size):
  """PIL BOX resize of (H, W, C) `x` to `size` (h, w): rows, then columns (PIL's horizontal pass
  comes first; without rounding in between the order does not matter beyond float error)."""
  hw = tf.shape(x)[:2]
  x = tf.einsum("oh,hwc->owc", _box_resize_matrix(hw[0], size[0]), x)
  return tf.einsum("pw,owc->opc", _box_resize_matrix(hw[1], size[1]), x)


def _pixelate(x, c, seed):
  """PIL BOX resize to int(side * c), then BOX back up (nearest-pixel copies). The reference rounds
  to uint8 after each pass; on integer input this differs from it by at most 1/255."""
  hw = tf.shape(x)[:2]
  small = tf.maximum(tf.cast(tf.floor(tf.cast(hw, tf.float64) * c), tf.int32), 1)
  return _box_resize(_box_resize(x, small), hw)


_FUNCTIONS = {name: globals()[f"_{name}"] for name in CORRUPTIONS}
KIND = components.Kind(preprocessing.CORRUPTIONS)  # no keys: eval.corruptions names them
for _name, _fn in _FUNCTIONS.items():  # the names eval.corruptions may choose
  components.register(KIND, _name, _fn)


@register("corrupt")
def get_corrupt(name: str, severity: int = 3, key: str = "image"):
  """CIFAR-10-C corruption `name` at `severity` 1..5 on an RGB image in [0, 255] (uint8 or float,
  after decode/resize, before value_range); out: float32 in [0, 255], same shape. Only brightness
  and saturate need 3 channels; the others corrupt each channel of any image."""
  if name not in _PARAMS:
    raise PreprocessError(f"unknown corruption {name!r}; valid corruptions: "
                          f"{', '.join(CORRUPTIONS)}")
  if isinstance(severity, bool) or not isinstance(severity, int) or severity not in SEVERITIES:
    raise PreprocessError(f"corruption severity must be an integer from {SEVERITIES[0]} to "
                          f"{SEVERITIES[-1]}, got {severity!r}")
  fn, c = _FUNCTIONS[name], _PARAMS[name][severity - 1]

  def op(example):
    image = example[key]
    if name in _HSV_CORRUPTIONS and image.shape[-1] not in (3, None):
      raise PreprocessError(f"corrupt({name!r}) works in HSV and needs RGB images, got "
                            f"{image.shape[-1]} channel(s) under {key!r}: decode(3) before it")
    seed = _next_seed(example) if name in RANDOM_CORRUPTIONS else None
    x = tf.cast(image, tf.float32) / 255.0
    out = tf.clip_by_value(fn(x, c, seed), 0.0, 1.0) * 255.0
    out.set_shape(image.shape)
    example[key] = out
    return example
  return op
