"""Preprocessing ops (runner/data/pp_ops.py) on small synthetic tensors: values, shapes, randomness."""
from __future__ import annotations

import io

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from runner.data import pp_ops
from runner.data.pp_ops import PreprocessError
from runner.errors import UserError

RANDOM_SPECS = ["random_crop(6)", "flip_lr", "inception_crop", "inception_crop(5)"]


def run(spec: str, **example):
  """Applies `spec` eagerly to an example made of the given values (converted to tensors)."""
  example = {k: v if isinstance(v, tf.Tensor) else tf.constant(v) for k, v in example.items()}
  return pp_ops.parse(spec)(example)


def run_graph(spec: str, **example):
  """Applies `spec` inside tf.data (graph mode, as the pipeline does) and returns numpy values."""
  ds = tf.data.Dataset.from_tensors({k: tf.constant(v) for k, v in example.items()})
  return next(ds.map(pp_ops.parse(spec)).as_numpy_iterator())


def encode(array: np.ndarray, mode: str, fmt: str = "PNG") -> bytes:
  buf = io.BytesIO()
  Image.fromarray(array, mode=mode).save(buf, format=fmt)
  return buf.getvalue()


def ramp(h: int, w: int, c: int = 3, dtype=np.int32) -> np.ndarray:
  """An image whose every pixel is distinct (so a crop can be located in it)."""
  return np.arange(h * w * c, dtype=dtype).reshape(h, w, c)


def rng(*seed: int) -> tf.Tensor:
  return tf.constant(list(seed), tf.int64)


def find_window(image: np.ndarray, crop: np.ndarray) -> tuple[int, int]:
  """(top, left) where `crop` is a contiguous window of `image`; fails if it is not one."""
  hits = np.argwhere(np.all(image == crop[0, 0], axis=-1))
  assert len(hits) == 1, "crop's corner pixel is not a pixel of the image"
  top, left = hits[0]
  h, w = crop.shape[:2]
  np.testing.assert_array_equal(crop, image[top:top + h, left:left + w])
  return int(top), int(left)


def test_registry_holds_exactly_the_tested_ops():
  # A new op must get tests here: this list is what the tests below cover (corrupt: in
  # test_data_corruptions.py; importing runner.data registers it).
  assert pp_ops.registered_ops() == ["central_crop", "corrupt", "decode", "flip_lr",
                                     "inception_crop", "keep", "onehot", "pad", "random_crop",
                                     "resize", "resize_small", "value_range"]


# --- decode -----------------------------------------------------------------------------------

def _pixels(mode: str) -> np.ndarray:
  shape = {"L": (5, 7), "RGB": (5, 7, 3), "RGBA": (5, 7, 4)}[mode]
  return np.random.default_rng(len(mode)).integers(0, 256, shape, dtype=np.uint8)


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
def test_decode_png_to_rgb_keeps_pixel_values(mode):
  pixels = _pixels(mode)
  out = run("decode(3)", image=encode(pixels, mode))["image"].numpy()
  assert out.dtype == np.uint8 and out.shape == (5, 7, 3)
  want = np.repeat(pixels[..., None], 3, axis=-1) if mode == "L" else pixels[..., :3]
  np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
def test_decode_in_tf_data_graph_has_static_channels(mode):
  pixels = _pixels(mode)
  ds = tf.data.Dataset.from_tensors({"image": tf.constant(encode(pixels, mode))})
  ds = ds.map(pp_ops.parse("decode(3)"))
  assert ds.element_spec["image"].shape.as_list() == [None, None, 3]
  out = next(ds.as_numpy_iterator())["image"]
  assert out.shape == (5, 7, 3)


def test_decode_to_grey():
  grey = _pixels("L")
  np.testing.assert_array_equal(run("decode(1)", image=encode(grey, "L"))["image"].numpy(),
                                grey[..., None])
  # An RGB image whose channels are equal converts back to that grey level.
  rgb = np.repeat(grey[..., None], 3, axis=-1)
  out = run("decode(1)", image=encode(rgb, "RGB"))["image"].numpy()
  assert out.shape == (5, 7, 1)
  np.testing.assert_allclose(out[..., 0].astype(int), grey.astype(int), atol=1)


def test_decode_jpeg_gives_approximately_the_colour():
  solid = np.full((16, 16, 3), (200, 40, 90), np.uint8)
  out = run("decode(3)", image=encode(solid, "RGB", "JPEG"))["image"].numpy()
  assert out.shape == (16, 16, 3) and out.dtype == np.uint8
  np.testing.assert_allclose(out.astype(int), solid.astype(int), atol=4)


def test_decode_of_already_decoded_uint8_image_only_fixes_channels():
  grey = _pixels("L")[..., None]
  out = run("decode(3)", image=grey)["image"].numpy()
  np.testing.assert_array_equal(out, np.repeat(grey, 3, axis=-1))
  rgba = _pixels("RGBA")
  np.testing.assert_array_equal(run("decode(3)", image=rgba)["image"].numpy(), rgba[..., :3])


def test_decode_other_key():
  pixels = _pixels("RGB")
  out = run("decode(3, key='other')", other=encode(pixels, "RGB"), image=b"untouched")
  np.testing.assert_array_equal(out["other"].numpy(), pixels)
  assert out["image"].numpy() == b"untouched"


def test_decode_grey_alpha_png():
  la = np.stack([_pixels("L"), np.full((5, 7), 255, np.uint8)], axis=-1)
  out = run("decode(3)", image=encode(la, "LA"))["image"].numpy()
  np.testing.assert_array_equal(out, np.repeat(la[..., :1], 3, axis=-1))


# --- resize, resize_small, central_crop, pad --------------------------------------------------

@pytest.mark.parametrize("size,want", [(4, (4, 4)), ((3, 9), (3, 9)), ([6, 2], (6, 2))])
def test_resize_sizes(size, want):
  out = run(f"resize({size!r})", image=np.zeros((10, 7, 3), np.uint8))["image"]
  assert tuple(out.shape) == want + (3,)
  assert out.dtype == tf.uint8


def test_resize_keeps_constant_images_and_dtypes():
  out = run("resize(5)", image=np.full((2, 3, 3), 200, np.uint8))["image"].numpy()
  assert out.dtype == np.uint8
  np.testing.assert_array_equal(out, 200)
  out = run("resize(5)", image=np.full((2, 3, 1), 0.25, np.float32))["image"].numpy()
  assert out.dtype == np.float32 and out.shape == (5, 5, 1)
  np.testing.assert_allclose(out, 0.25, rtol=1e-6)


def test_resize_nearest_replicates_pixels():
  image = np.array([[1, 2], [3, 4]], np.uint8)[..., None]
  out = run("resize(4, method='nearest')", image=image)["image"].numpy()[..., 0]
  np.testing.assert_array_equal(out, [[1, 1, 2, 2], [1, 1, 2, 2], [3, 3, 4, 4], [3, 3, 4, 4]])


def test_resize_uint8_stays_in_range():
  # Bicubic overshoots at sharp edges; the op must clip before casting back to uint8.
  image = np.zeros((8, 8, 1), np.uint8)
  image[:, 4:] = 255
  out = run("resize(17, method='bicubic')", image=image)["image"].numpy()
  assert out[:, :6].min() == 0 and out[:, -6:].max() == 255
  # No wrap-around from -x or 255+x. (The cast truncates, as big_vision's resize does, so a flat
  # 255 region computed as 254.9999 comes out as 254.)
  assert out[:, :3].max() <= 1 and out[:, -3:].min() >= 254


@pytest.mark.parametrize("shape,smaller,want", [((20, 10), 5, (10, 5)), ((10, 20), 5, (5, 10)),
                                                 ((9, 9), 18, (18, 18)), ((30, 45), 20, (20, 30))])
def test_resize_small_keeps_aspect_ratio(shape, smaller, want):
  out = run(f"resize_small({smaller})", image=np.full(shape + (3,), 77, np.uint8))["image"]
  assert tuple(out.shape) == want + (3,)
  assert out.dtype == tf.uint8
  np.testing.assert_array_equal(out.numpy(), 77)


def test_central_crop_takes_the_centre_pixels():
  image = ramp(4, 4)
  np.testing.assert_array_equal(run("central_crop(2)", image=image)["image"].numpy(),
                                image[1:3, 1:3])
  image = ramp(5, 7)  # odd margins: top = (5-2)//2 = 1, left = (7-3)//2 = 2
  np.testing.assert_array_equal(run("central_crop((2, 3))", image=image)["image"].numpy(),
                                image[1:3, 2:5])
  np.testing.assert_array_equal(run("central_crop(5)", image=ramp(5, 5))["image"].numpy(),
                                ramp(5, 5))


def test_pad_adds_zero_border():
  image = ramp(3, 4) + 1
  out = run("pad(2)", image=image)["image"].numpy()
  assert out.shape == (7, 8, 3)
  np.testing.assert_array_equal(out[2:5, 2:6], image)
  border = np.ones(out.shape, bool)
  border[2:5, 2:6] = False
  assert (out[border] == 0).all()


# --- random ops ---------------------------------------------------------------------------------

def test_random_crop_is_a_window_of_the_image():
  image = ramp(12, 10)
  corners = set()
  for seed in range(12):
    out = run("random_crop(6)", image=image, _rng=rng(seed, 3))["image"].numpy()
    assert out.shape == (6, 6, 3)
    corners.add(find_window(image, out))
  assert all(0 <= t <= 6 and 0 <= l <= 4 for t, l in corners)
  assert len(corners) >= 4, corners


def test_random_crop_of_rectangular_size():
  out = run("random_crop((3, 5))", image=ramp(8, 8), _rng=rng(0, 0))["image"].numpy()
  assert out.shape == (3, 5, 3)
  find_window(ramp(8, 8), out)


def test_flip_lr_flips_or_not():
  image = ramp(4, 5)
  flipped = 0
  for seed in range(16):
    out = run("flip_lr", image=image, _rng=rng(7, seed))["image"].numpy()
    if np.array_equal(out, image[:, ::-1]):
      flipped += 1
    else:
      np.testing.assert_array_equal(out, image)
  assert 0 < flipped < 16


def test_inception_crop_without_size_is_a_window_of_enough_area():
  image = ramp(20, 20)
  shapes = set()
  for seed in range(10):
    out = run("inception_crop", image=image, _rng=rng(seed, 1))["image"].numpy()
    h, w, c = out.shape
    assert c == 3 and 1 <= h <= 20 and 1 <= w <= 20
    assert h * w >= 0.05 * 400 * 0.9  # 5% of the area at least (up to rounding)
    find_window(image, out)
    shapes.add((h, w))
  assert len(shapes) >= 3


def test_inception_crop_with_size_resizes_and_keeps_dtype():
  out = run("inception_crop((5, 7))", image=np.full((20, 16, 3), 9, np.uint8), _rng=rng(1, 2))
  assert out["image"].dtype == tf.uint8 and tuple(out["image"].shape) == (5, 7, 3)
  np.testing.assert_array_equal(out["image"].numpy(), 9)
  out = run("inception_crop(8, area_min=50, area_max=50)",
            image=ramp(20, 20, dtype=np.float32), _rng=rng(1, 2))
  assert out["image"].dtype == tf.float32 and tuple(out["image"].shape) == (8, 8, 3)


@pytest.mark.parametrize("spec", RANDOM_SPECS)
def test_random_op_is_a_function_of_rng(spec):
  image = ramp(16, 16).astype(np.float32)
  outs = []
  for seed in range(8):
    a = run(spec, image=image, _rng=rng(seed, 11))
    b = run(spec, image=image, _rng=rng(seed, 11))
    np.testing.assert_array_equal(a["image"].numpy(), b["image"].numpy())
    np.testing.assert_array_equal(a["_rng"].numpy(), b["_rng"].numpy())
    outs.append(a["image"].numpy())
  distinct = {(o.shape, o.tobytes()) for o in outs}
  assert len(distinct) >= 2, f"{spec} gives the same output for 8 different seeds"


@pytest.mark.parametrize("spec", RANDOM_SPECS)
def test_random_op_is_the_same_in_graph_mode(spec):
  image = ramp(16, 16).astype(np.float32)
  eager = run(spec, image=image, _rng=rng(4, 2))
  graph = run_graph(spec, image=image, _rng=np.array([4, 2], np.int64))
  np.testing.assert_array_equal(eager["image"].numpy(), graph["image"])
  np.testing.assert_array_equal(eager["_rng"].numpy(), graph["_rng"])


@pytest.mark.parametrize("spec", RANDOM_SPECS)
def test_random_op_advances_rng(spec):
  before = rng(3, 5)
  out = run(spec, image=ramp(16, 16).astype(np.float32), _rng=before)
  assert out["_rng"].dtype == tf.int64 and tuple(out["_rng"].shape) == (2,)
  assert not np.array_equal(out["_rng"].numpy(), before.numpy())


@pytest.mark.parametrize("spec", ["random_crop(4)", "flip_lr", "value_range(0, 1)", "pad(1)",
                                  "resize(3)", "central_crop(2)", "onehot(3)", "keep('image')"])
def test_only_random_ops_touch_rng(spec):
  example = {"image": ramp(6, 6).astype(np.float32), "label": np.int64(1),
             "_rng": np.array([3, 5], np.int64)}
  out = run(spec, **example)
  changed = not np.array_equal(out["_rng"].numpy(), [3, 5])
  assert changed == (spec in ("random_crop(4)", "flip_lr"))


def test_consecutive_random_ops_draw_independent_seeds():
  # If the second flip reused the first one's seed the two would always cancel out.
  image = ramp(3, 4)
  results = [run("flip_lr|flip_lr", image=image, _rng=rng(1, s))["image"].numpy()
             for s in range(24)]
  assert any(np.array_equal(r, image[:, ::-1]) for r in results)
  assert any(np.array_equal(r, image) for r in results)
  # Two crops in a row: the second crop's offset is not a function of the first one's.
  big = ramp(16, 16)
  pairs = set()
  for s in range(24):
    first = run("random_crop(10)", image=big, _rng=rng(2, s))
    second = pp_ops.parse("random_crop(4)")(dict(first))
    pairs.add((find_window(big, first["image"].numpy()),
               find_window(first["image"].numpy(), second["image"].numpy())))
  firsts = {p[0] for p in pairs}
  assert len(pairs) > len(firsts)  # some first offset is followed by different second offsets
  assert len({p[1] for p in pairs}) >= 4


# --- value_range, onehot, keep ----------------------------------------------------------------

@pytest.mark.parametrize("vmin,vmax", [(-1, 1), (0, 1), (1, -1), (-2.5, 7.25), (0.1, 0.3)])
def test_value_range_maps_ends_exactly(vmin, vmax):
  out = run(f"value_range({vmin}, {vmax})", image=np.array([0, 255, 51], np.uint8))["image"]
  assert out.dtype == tf.float32
  got = out.numpy()
  assert got[0] == np.float32(vmin) and got[1] == np.float32(vmax)
  np.testing.assert_allclose(got[2], vmin + 0.2 * (vmax - vmin), rtol=1e-6)


def test_value_range_on_a_whole_image_and_custom_input_range():
  image = np.arange(256, dtype=np.uint8).reshape(16, 16, 1)
  got = run("value_range(-1, 1)", image=image)["image"].numpy()
  assert got.min() == -1 and got.max() == 1 and np.all(np.diff(got.ravel()) > 0)
  got = run("value_range(0, 1, 0, 16)", image=np.array([0, 8, 16], np.uint8))["image"].numpy()
  np.testing.assert_array_equal(got, [0.0, 0.5, 1.0])


def test_onehot_int_label():
  out = run("onehot(5)", label=np.int64(3))
  assert out["labels"].dtype == tf.float32
  np.testing.assert_array_equal(out["labels"].numpy(), [0, 0, 0, 1, 0])
  assert out["label"].numpy() == 3  # the source label is kept
  out = run("onehot(4, on=0.9, off=0.1)", label=np.int32(0))
  np.testing.assert_allclose(out["labels"].numpy(), [0.9, 0.1, 0.1, 0.1], rtol=1e-6)


def test_onehot_list_of_labels_is_multi_hot():
  out = run("onehot(6)", label=np.array([1, 4, 1], np.int64))
  np.testing.assert_array_equal(out["labels"].numpy(), [0, 1, 0, 0, 1, 0])
  out = run("onehot(3, on=0.8, off=-0.2)", label=np.array([2, 0], np.int64))
  np.testing.assert_allclose(out["labels"].numpy(), [0.8, -0.2, 0.8], rtol=1e-6)


def test_onehot_keys():
  out = run("onehot(3, key='y', key_result='target')", y=np.int64(2))
  np.testing.assert_array_equal(out["target"].numpy(), [0, 0, 1])
  assert "labels" not in out


def test_onehot_empty_label_list_is_all_off():
  out = run("onehot(3)", label=np.zeros([0], np.int64))
  np.testing.assert_array_equal(out["labels"].numpy(), [0, 0, 0])


def test_keep_drops_other_keys_but_keeps_private_ones():
  out = run("keep('image', 'labels')", image=np.zeros((2, 2, 3)), labels=np.ones(3),
            label=np.int64(1), extra=b"x", _rng=np.array([1, 2], np.int64))
  assert sorted(out) == ["_rng", "image", "labels"]


# --- parse ------------------------------------------------------------------------------------

def test_empty_spec_is_identity():
  example = {"image": tf.constant([1, 2])}
  assert pp_ops.parse("")(dict(example)) == example
  assert pp_ops.parse(" | ")(dict(example)) == example


def test_spec_tolerates_whitespace_and_chains_in_order():
  out = run(" pad( 1 ) |value_range(0, 2, 0, 1) | central_crop(2)",
            image=np.ones((2, 2, 1), np.uint8))["image"].numpy()
  np.testing.assert_array_equal(out[..., 0], [[2, 2], [2, 2]])  # the crop sees the padded image


def test_unknown_op_lists_registered_ops():
  with pytest.raises(PreprocessError) as e:
    pp_ops.parse("decode(3)|frobnicate(2)|flip_lr")
  msg = str(e.value)
  assert "'frobnicate'" in msg
  for name in pp_ops.registered_ops():
    assert name in msg


@pytest.mark.parametrize("spec", ["decode(", "value_range(-1, 1", "resize(3))", "keep('a",
                                  "resize(3) flip_lr", "1+"])
def test_syntax_errors(spec):
  with pytest.raises(PreprocessError, match="cannot parse"):
    pp_ops.parse(spec)


@pytest.mark.parametrize("spec", ["resize(size)", "resize(2 * x)", "onehot(int('3'))",
                                  "resize(*[3])", "value_range(vmin=lo)"])
def test_non_literal_arguments(spec):
  with pytest.raises(PreprocessError, match="literals"):
    pp_ops.parse(spec)


@pytest.mark.parametrize("spec", ["a.b", "decode(3)(1)", "'decode'", "[1]"])
def test_not_an_op_call(spec):
  with pytest.raises(PreprocessError, match="not of the form"):
    pp_ops.parse(spec)


@pytest.mark.parametrize("spec", ["resize()", "resize(1, 2, 3, 4, 5)", "resize(4, sizes=2)",
                                  "flip_lr(1, 2)"])
def test_bad_arguments(spec):
  with pytest.raises(PreprocessError, match="bad arguments"):
    pp_ops.parse(spec)


def test_preprocess_error_is_a_user_and_value_error():
  assert issubclass(PreprocessError, UserError) and issubclass(PreprocessError, ValueError)
