"""CIFAR-10-C corruptions (runner/data/corruptions.py) against the reference definitions.

The reference is hendrycks/robustness, ImageNet-C/create_c/make_cifar_c.py. Each deterministic
corruption is recomputed here independently from that script's definition with NumPy, SciPy,
matplotlib or PIL (the library the script itself calls, where it is installed); random ones are
checked for reproducibility and for the statistics of their noise model.
"""
from __future__ import annotations

import io

import matplotlib.colors
import numpy as np
import pytest
import scipy.ndimage
import skimage.data
import tensorflow as tf
from PIL import Image

from runner import data
from runner.data import corruptions, pp_ops
from runner.data.pp_ops import PreprocessError
from runner.errors import UserError
from runner.models import inputs

# Severity 1..5 -> parameter, copied from make_cifar_c.py (not from the module under test).
REFERENCE = {
    "gaussian_noise": [0.04, 0.06, .08, .09, .10],
    "shot_noise": [500, 250, 100, 75, 50],
    "impulse_noise": [.01, .02, .03, .05, .07],
    "speckle_noise": [.06, .1, .12, .16, .2],
    "gaussian_blur": [.4, .6, 0.7, .8, 1],
    "defocus_blur": [(0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)],
    "contrast": [.75, .5, .4, .3, 0.15],
    "brightness": [.05, .1, .15, .2, .3],
    "saturate": [(0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)],
    "jpeg_compression": [80, 65, 58, 50, 40],
    "pixelate": [0.95, 0.9, 0.85, 0.75, 0.65],
}
NAMES = sorted(REFERENCE)
RANDOM = ["gaussian_noise", "impulse_noise", "shot_noise", "speckle_noise"]
SEVERITIES = [1, 2, 3, 4, 5]


def _resized(image: np.ndarray, h: int, w: int) -> np.ndarray:
  return np.asarray(Image.fromarray(image).resize((w, h), Image.BOX))


# Natural RGB images shipped with scikit-image: a CIFAR-sized cat, a non-square crop, a tiny one.
CAT = _resized(skimage.data.chelsea(), 32, 32)
ASTRONAUT = _resized(skimage.data.astronaut(), 29, 37)
TINY = _resized(skimage.data.coffee(), 4, 3)
IMAGES = {"cat32": CAT, "astronaut29x37": ASTRONAUT, "tiny4x3": TINY}


def corrupt(image, name: str, severity: int, seed=(0, 0)) -> np.ndarray:
  """The op, eagerly, on one image (uint8 or float in [0, 255])."""
  example = {"image": tf.constant(image), "_rng": tf.constant(seed, tf.int64)}
  return pp_ops.parse(f"corrupt({name!r}, {severity})")(example)["image"].numpy()


def unit(image) -> np.ndarray:
  return np.asarray(image, np.float64) / 255.0


def to_output(x: np.ndarray) -> np.ndarray:
  """The reference's last step: clip to [0, 1], back to [0, 255]."""
  return np.clip(x, 0, 1) * 255


def constant_image(levels, size: int = 64) -> np.ndarray:
  """Side-by-side (size, size, 3) blocks of constant uint8 value, one per level."""
  return np.concatenate([np.full((size, size, 3), v, np.uint8) for v in levels], axis=1)


# --- registration and parsing ---------------------------------------------------------------------

def test_tables_are_the_reference_ones():
  assert corruptions.CORRUPTIONS == tuple(corruptions._PARAMS)
  assert sorted(corruptions.CORRUPTIONS) == NAMES
  for name in NAMES:
    assert list(corruptions._PARAMS[name]) == REFERENCE[name], name
  assert sorted(corruptions.RANDOM_CORRUPTIONS) == RANDOM


def test_corrupt_is_registered_by_importing_the_data_package():
  assert "corrupt" in pp_ops.registered_ops()
  spec = "decode(3)|resize(32)|corrupt('contrast', 3)|value_range(-1,1)"
  png = io.BytesIO()
  Image.fromarray(ASTRONAUT).save(png, format="PNG")
  out = pp_ops.parse(spec)({"image": tf.constant(png.getvalue())})["image"].numpy()
  want = 2 * corrupt(_tf_resize(ASTRONAUT, 32), "contrast", 3) / 255 - 1
  assert out.shape == (32, 32, 3)
  np.testing.assert_allclose(out, want, atol=1e-6)


def _tf_resize(image, size):
  return pp_ops.parse(f"resize({size})")({"image": tf.constant(image)})["image"].numpy()


@pytest.mark.parametrize("spec", ['corrupt("pixelate", 2)', "corrupt('pixelate', severity=2)",
                                  "corrupt(name='pixelate', severity=2)",
                                  " corrupt( 'pixelate' , 2 ) "])
def test_spec_forms(spec):
  example = {"image": tf.constant(CAT)}
  np.testing.assert_array_equal(pp_ops.parse(spec)(example)["image"].numpy(),
                                corrupt(CAT, "pixelate", 2))


def test_default_severity_is_3():
  out = pp_ops.parse("corrupt('contrast')")({"image": tf.constant(CAT)})["image"].numpy()
  np.testing.assert_array_equal(out, corrupt(CAT, "contrast", 3))


@pytest.mark.parametrize("spec", ["corrupt('fog', 3)", "corrupt('Gaussian_Noise', 3)",
                                  "corrupt('', 1)"])
def test_unknown_corruption_names_the_valid_ones(spec):
  with pytest.raises(PreprocessError, match="unknown corruption") as err:
    pp_ops.parse(f"decode(3)|{spec}")
  assert isinstance(err.value, UserError)
  for name in NAMES:
    assert name in str(err.value)


@pytest.mark.parametrize("severity", ["0", "6", "-1", "2.5", "3.0", "'3'", "True", "None",
                                      "(1, 2)"])
def test_bad_severity_names_the_valid_range(severity):
  with pytest.raises(PreprocessError, match="from 1 to 5"):
    pp_ops.parse(f"corrupt('gaussian_noise', {severity})")


@pytest.mark.parametrize("spec,match", [("corrupt(gaussian_noise, 3)", "quoted strings"),
                                        ("corrupt", "bad arguments"),
                                        ("corrupt('contrast', 3, 'image', 4)", "bad arguments"),
                                        ("corrupt('contrast', level=3)", "bad arguments")])
def test_malformed_corrupt_spec(spec, match):
  with pytest.raises(PreprocessError, match=match):
    pp_ops.parse(spec)


@pytest.mark.parametrize("name", ["brightness", "saturate"])
def test_hsv_corruptions_need_rgb(name, tfds_dir):
  grey = {"image": tf.constant(CAT[..., :1]), "_rng": tf.constant([0, 0], tf.int64)}
  with pytest.raises(PreprocessError, match="decode\\(3\\)"):
    pp_ops.parse(f"corrupt({name!r}, 1)")(grey)
  uci = data.open_source("uci_digits", data_dir=str(tfds_dir))
  with pytest.raises(PreprocessError, match="needs RGB"):
    data.eval_batches(uci, "validation", f"decode(1)|corrupt({name!r}, 1)", 8)


# --- deterministic corruptions vs independent reimplementations ----------------------------------

@pytest.mark.parametrize("image", IMAGES)
@pytest.mark.parametrize("severity", SEVERITIES)
def test_gaussian_blur_is_scipy_gaussian_filter(image, severity):
  # skimage.filters.gaussian(sigma=c, multichannel=True): scipy's filter, mode 'nearest',
  # truncate 4, no blur across channels.
  c = REFERENCE["gaussian_blur"][severity - 1]
  x = unit(IMAGES[image])
  want = to_output(scipy.ndimage.gaussian_filter(x, sigma=(c, c, 0), mode="nearest", truncate=4.0))
  np.testing.assert_allclose(corrupt(IMAGES[image], "gaussian_blur", severity), want, atol=2e-3)


def reference_disk(radius: float, alias_blur: float) -> np.ndarray:
  """make_cifar_c.disk: normalised disk on a 17x17 grid, then cv2.GaussianBlur(ksize=(3, 3),
  sigmaX=alias_blur): separable cv2.getGaussianKernel(3, sigma) weights, BORDER_REFLECT_101."""
  t = np.arange(-8, 8 + 1)
  xx, yy = np.meshgrid(t, t)
  disk = np.array((xx ** 2 + yy ** 2) <= radius ** 2, dtype=np.float32)
  disk /= np.sum(disk)
  g = np.exp(-np.array([-1.0, 0.0, 1.0]) ** 2 / (2 * alias_blur ** 2))
  g /= g.sum()
  padded = np.pad(disk.astype(np.float64), 1, mode="reflect")  # numpy 'reflect' = REFLECT_101
  rows = g[0] * padded[:-2] + g[1] * padded[1:-1] + g[2] * padded[2:]
  return g[0] * rows[:, :-2] + g[1] * rows[:, 1:-1] + g[2] * rows[:, 2:]


def filter2d(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
  """cv2.filter2D(x[..., d], -1, kernel) per channel: correlation with the kernel's centre as
  anchor, border BORDER_REFLECT_101, computed as a direct sum over kernel taps."""
  r = kernel.shape[0] // 2
  h, w = x.shape[:2]
  padded = np.pad(x, ((r, r), (r, r), (0, 0)), mode="reflect")
  out = np.zeros_like(x)
  for i in range(kernel.shape[0]):
    for j in range(kernel.shape[1]):
      out += kernel[i, j] * padded[i:i + h, j:j + w]
  return out


def test_reference_disk_kernels():
  # Severities 1-3: a one-pixel disk, i.e. a 3x3 Gaussian; 4: a plus; 5: a 3x3 box (sharp blur).
  for radius, blur in REFERENCE["defocus_blur"]:
    k = reference_disk(radius, blur)
    assert k.shape == (17, 17) and abs(k.sum() - 1) < 1e-6 and np.allclose(k, k.T)
    assert np.all(k[:6] < 1e-20) and np.all(k[11:] < 1e-20)  # support within the 5x5 centre
  np.testing.assert_allclose(reference_disk(1.5, 0.1)[7:10, 7:10], np.full((3, 3), 1 / 9),
                             atol=1e-9)


@pytest.mark.parametrize("image", IMAGES)
@pytest.mark.parametrize("severity", SEVERITIES)
def test_defocus_blur_is_filter2d_with_the_disk(image, severity):
  x = unit(IMAGES[image])
  want = to_output(filter2d(x, reference_disk(*REFERENCE["defocus_blur"][severity - 1])))
  np.testing.assert_allclose(corrupt(IMAGES[image], "defocus_blur", severity), want, atol=2e-3)


@pytest.mark.parametrize("image", IMAGES)
@pytest.mark.parametrize("severity", SEVERITIES)
def test_contrast(image, severity):
  c = REFERENCE["contrast"][severity - 1]
  x = unit(IMAGES[image])
  means = x.mean(axis=(0, 1), keepdims=True)
  np.testing.assert_allclose(corrupt(IMAGES[image], "contrast", severity),
                             to_output((x - means) * c + means), atol=2e-3)


@pytest.mark.parametrize("image", IMAGES)
@pytest.mark.parametrize("severity", SEVERITIES)
def test_brightness_adds_to_hsv_value(image, severity):
  c = REFERENCE["brightness"][severity - 1]
  hsv = matplotlib.colors.rgb_to_hsv(unit(IMAGES[image]))
  hsv[..., 2] = np.clip(hsv[..., 2] + c, 0, 1)
  want = to_output(matplotlib.colors.hsv_to_rgb(hsv))
  np.testing.assert_allclose(corrupt(IMAGES[image], "brightness", severity), want, atol=2e-3)


@pytest.mark.parametrize("image", IMAGES)
@pytest.mark.parametrize("severity", SEVERITIES)
def test_saturate_scales_hsv_saturation(image, severity):
  c = REFERENCE["saturate"][severity - 1]
  hsv = matplotlib.colors.rgb_to_hsv(unit(IMAGES[image]))
  hsv[..., 1] = np.clip(hsv[..., 1] * c[0] + c[1], 0, 1)
  want = to_output(matplotlib.colors.hsv_to_rgb(hsv))
  np.testing.assert_allclose(corrupt(IMAGES[image], "saturate", severity), want, atol=2e-3)


def test_hsv_corruptions_on_grey_and_extreme_pixels():
  # Grey pixels have no hue: brightness keeps them grey; saturate 4 and 5 (offset > 0) tint them
  # red (hue 0), as skimage's hsv2rgb does.
  grey = np.array([[[0, 0, 0], [90, 90, 90], [255, 255, 255]]], np.uint8)
  np.testing.assert_allclose(corrupt(grey, "brightness", 5)[0, :, 0],
                             [0.3 * 255, 90 + 0.3 * 255, 255], atol=1e-3)
  assert np.all(np.ptp(corrupt(grey, "brightness", 5), axis=-1) < 1e-3)
  np.testing.assert_allclose(corrupt(grey, "saturate", 2), grey, atol=1e-3)
  tinted = corrupt(grey, "saturate", 5)[0, 1]  # v = 90/255, s = 0.2, h = 0
  np.testing.assert_allclose(tinted, [90, 90 * 0.8, 90 * 0.8], atol=1e-3)


@pytest.mark.parametrize("image", IMAGES)
@pytest.mark.parametrize("severity", SEVERITIES)
def test_jpeg_compression_is_pils_round_trip(image, severity):
  buf = io.BytesIO()
  quality = REFERENCE["jpeg_compression"][severity - 1]
  Image.fromarray(IMAGES[image]).save(buf, "JPEG", quality=quality)
  want = np.asarray(Image.open(buf), np.float32)
  np.testing.assert_array_equal(corrupt(IMAGES[image], "jpeg_compression", severity), want)


def test_jpeg_compression_of_float_input_rounds_first():
  x = CAT.astype(np.float32) + 0.3  # rounds back to CAT
  np.testing.assert_array_equal(corrupt(x, "jpeg_compression", 4),
                                corrupt(CAT, "jpeg_compression", 4))


def _pil_pixelate(image: np.ndarray, c: float, mode: str) -> np.ndarray:
  """make_cifar_c.pixelate for any size: PIL BOX resize to int(side * c), then BOX back."""
  h, w = image.shape[:2]
  small = (max(int(w * c), 1), max(int(h * c), 1))
  if mode == "F":  # float channels: PIL's exact (double) resampling, no rounding
    return np.stack([np.asarray(Image.fromarray(image[..., d].astype(np.float32), mode="F")
                                .resize(small, Image.BOX).resize((w, h), Image.BOX))
                     for d in range(image.shape[-1])], axis=-1)
  return np.asarray(Image.fromarray(image).resize(small, Image.BOX).resize((w, h), Image.BOX),
                    np.float32)


@pytest.mark.parametrize("image", IMAGES)
@pytest.mark.parametrize("severity", SEVERITIES)
def test_pixelate_is_pils_box_resize(image, severity):
  # make_cifar_c resizes uint8 PIL images, which rounds after each pass: within one level of
  # the unrounded result, which equals PIL's float ('F') resampling.
  c = REFERENCE["pixelate"][severity - 1]
  out = corrupt(IMAGES[image], "pixelate", severity)
  np.testing.assert_allclose(out, _pil_pixelate(IMAGES[image], c, "F"), atol=1e-3)
  np.testing.assert_allclose(out, _pil_pixelate(IMAGES[image], c, "RGB"), atol=1 + 1e-3)


def test_pixelate_averages_whole_pixels():
  # 32 -> 24 -> 32: each of the 24 box outputs is the mean of 1 or 2 *whole* input pixels (PIL
  # BOX), not an area-weighted mean; and 24 columns give at most 24 distinct columns back.
  ramp = np.tile(np.arange(32, dtype=np.uint8)[None, :, None] * 8, (32, 1, 3))
  out = corrupt(ramp, "pixelate", 4)
  row = out[0, :, 0] / 8
  assert len(np.unique(row)) == 24
  assert set(np.unique(row * 2).round(4)) <= set(range(64))  # halves: means of 1 or 2 values


# --- random corruptions -------------------------------------------------------------------------

@pytest.mark.parametrize("name", RANDOM)
def test_random_same_seed_same_image_other_seed_differs(name):
  a = corrupt(CAT, name, 3, seed=(7, 11))
  np.testing.assert_array_equal(a, corrupt(CAT, name, 3, seed=(7, 11)))
  assert not np.array_equal(a, corrupt(CAT, name, 3, seed=(7, 12)))
  assert not np.array_equal(a, corrupt(CAT, name, 3, seed=(8, 11)))
  assert not np.allclose(a, CAT)


@pytest.mark.parametrize("name", NAMES)
def test_only_random_corruptions_consume_the_seed(name):
  example = {"image": tf.constant(CAT), "_rng": tf.constant([5, 6], tf.int64)}
  out = pp_ops.parse(f"corrupt({name!r}, 2)")(dict(example))
  changed = not np.array_equal(out["_rng"].numpy(), [5, 6])
  assert changed == (name in RANDOM)
  if name not in RANDOM:  # a deterministic function of the image
    np.testing.assert_array_equal(out["image"].numpy(), corrupt(CAT, name, 2, seed=(9, 9)))


@pytest.mark.parametrize("name", RANDOM)
def test_random_corruption_in_tf_data_equals_eager(name):
  ds = tf.data.Dataset.from_tensors({"image": tf.constant(CAT),
                                     "_rng": tf.constant([3, 4], tf.int64)})
  out = next(ds.map(pp_ops.parse(f"corrupt({name!r}, 4)")).as_numpy_iterator())["image"]
  np.testing.assert_array_equal(out, corrupt(CAT, name, 4, seed=(3, 4)))


def _noise(name, severity, levels, seed=(1, 2)):
  """(per-level corrupted values in [0, 1], per-level clean value in [0, 1])."""
  image = constant_image(levels)
  out = corrupt(image, name, severity, seed).reshape(64, len(levels), 64, 3) / 255.0
  return [out[:, i].ravel() for i in range(len(levels))], [v / 255.0 for v in levels]


@pytest.mark.parametrize("severity", SEVERITIES)
def test_gaussian_noise_is_additive_with_std_c(severity):
  c = REFERENCE["gaussian_noise"][severity - 1]
  outs, xs = _noise("gaussian_noise", severity, [90, 165])  # 3.5 std from 0 and 1: no clipping
  for out, x in zip(outs, xs):
    d = out - x
    assert abs(d.std() / c - 1) < 0.03
    assert abs(d.mean()) < 4 * c / np.sqrt(d.size)
    assert np.mean(np.abs(d) > 2 * c) == pytest.approx(0.0455, abs=0.006)  # normal tails


@pytest.mark.parametrize("severity", SEVERITIES)
def test_shot_noise_is_poisson_in_photon_counts(severity):
  c = REFERENCE["shot_noise"][severity - 1]
  outs, xs = _noise("shot_noise", severity, [51, 128])
  for out, x in zip(outs, xs):
    counts = out * c  # Poisson(x * c) photon counts
    np.testing.assert_allclose(counts, np.round(counts), atol=2e-3)
    assert abs(out.mean() / x - 1) < 0.01
    assert abs(out.var() / (x / c) - 1) < 0.05  # variance x / c: grows with the signal


@pytest.mark.parametrize("severity", SEVERITIES)
def test_impulse_noise_is_salt_and_pepper_per_value(severity):
  c = REFERENCE["impulse_noise"][severity - 1]
  image = constant_image([128], size=128)
  out = corrupt(image, "impulse_noise", severity)
  n = out.size
  salt, pepper = np.mean(out == 255), np.mean(out == 0)
  assert np.all((out == 255) | (out == 0) | (out == 128))
  tol = 4 * np.sqrt(c / 2 * (1 - c / 2) / n)
  assert abs(salt - c / 2) < tol and abs(pepper - c / 2) < tol
  # skimage's random_noise flips each channel value on its own, not whole pixels.
  per_pixel = (out != 128).sum(axis=-1)
  one = 3 * c * (1 - c) ** 2
  assert abs(np.mean(per_pixel == 1) - one) < 4 * np.sqrt(one / per_pixel.size)
  assert np.mean(per_pixel == 3) < c ** 2


@pytest.mark.parametrize("severity", SEVERITIES)
def test_speckle_noise_is_multiplicative_with_std_x_c(severity):
  c = REFERENCE["speckle_noise"][severity - 1]
  outs, xs = _noise("speckle_noise", severity, [40, 140])
  for out, x in zip(outs, xs):
    d = out - x
    assert abs(d.std() / (x * c) - 1) < 0.03
    assert abs(d.mean()) < 4 * x * c / np.sqrt(d.size)
  black = np.zeros((8, 8, 3), np.uint8)
  np.testing.assert_array_equal(corrupt(black, "speckle_noise", severity), 0)


# --- every corruption ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_change_grows_with_severity(name):
  change = [np.abs(corrupt(CAT, name, s, seed=(4, 2)) - CAT).mean() for s in SEVERITIES]
  if name == "saturate":
    # The reference table desaturates (x0.3, x0.1), then saturates (x1.5, x2 + 0.1, x2.5 + 0.2):
    # monotone within each half only.
    assert change[0] < change[1] and change[2] < change[3] < change[4], change
  else:
    assert all(a < b for a, b in zip(change, change[1:])), change
  assert change[0] > 0.5, change


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("image", ["uint8", "float", "black", "white", "grey_rgb"])
def test_output_is_float32_in_range_with_the_input_shape(name, image):
  x = {"uint8": CAT, "float": ASTRONAUT.astype(np.float32) * 0.99 + 0.7,
       "black": np.zeros((9, 5, 3), np.uint8), "white": np.full((9, 5, 3), 255, np.uint8),
       "grey_rgb": np.repeat(CAT[..., :1], 3, axis=-1)}[image]
  for severity in (1, 5):
    out = corrupt(x, name, severity)
    assert out.dtype == np.float32 and out.shape == x.shape
    assert np.all(np.isfinite(out)) and out.min() >= 0 and out.max() <= 255


@pytest.mark.parametrize("name", NAMES)
def test_in_tf_data_on_unknown_size_images(name):
  pngs = []
  for image in (CAT, ASTRONAUT):
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    pngs.append(buf.getvalue())
  seeds = np.array([[0, 0], [0, 1]], np.int64)
  ds = tf.data.Dataset.from_tensor_slices({"image": pngs, "_rng": seeds})
  ds = ds.map(pp_ops.parse(f"decode(3)|corrupt({name!r}, 5)"))
  assert ds.element_spec["image"].shape.as_list() == [None, None, 3]
  assert ds.element_spec["image"].dtype == tf.float32
  outs = list(ds.as_numpy_iterator())
  for out, image, seed in zip(outs, (CAT, ASTRONAUT), [(0, 0), (0, 1)]):
    np.testing.assert_allclose(out["image"], corrupt(image, name, 5, seed=seed), atol=1e-3)


@pytest.fixture(scope="module")
def digits(tfds_dir):
  """The embedded grey uci_digits source and its first 4 validation images, clean, in [-1, 1]."""
  uci = data.open_source("uci_digits", data_dir=str(tfds_dir))
  clean = data.eval_batches(uci, "validation[:4]", "decode(3)|resize(32)|value_range(-1,1)", 4)
  return uci, np.asarray(inputs.images(next(clean.as_numpy_iterator())))


# Every corruption runs in tf.data on unknown-size images above; here, through the real pipeline,
# one of each kind: random (seeded by position), HSV, per-channel filter, codec, resampling.
@pytest.mark.parametrize("name", ["gaussian_noise", "brightness", "saturate", "defocus_blur",
                                  "jpeg_compression", "pixelate"])
def test_on_embedded_grey_digits_after_decode_and_resize(name, digits):
  uci, clean = digits
  spec = f"decode(3)|resize(32)|corrupt({name!r}, 5)|value_range(-1,1)"
  out = next(data.eval_batches(uci, "validation[:4]", spec, 4).as_numpy_iterator())["image"]
  assert out.shape == (4, 32, 32, 3) and out.dtype == np.float32
  assert out.min() >= -1 and out.max() <= 1 and not np.allclose(out, clean)
  # Eval example i is seeded (0, i): the op inside the pipeline is the op on the clean image.
  for i in range(4):
    want = corrupt(np.round((clean[i] + 1) * 127.5).astype(np.uint8), name, 5, seed=(0, i))
    np.testing.assert_allclose(out[i], want / 127.5 - 1, atol=1e-5)
