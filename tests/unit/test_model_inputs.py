"""Images cross to the device as uint8 (runner/models/inputs.py, runner/data/pipeline.py): a spec
that ends in value_range leaves that op to the jitted step, which must compute what TensorFlow's
op computed on the host, for every value_range, padding rows and every function that reads a
batch's images (the eval, predict, feature and train steps, PGD). The reference is the same spec
run whole on the host: followed by `keep`, value_range is no longer its last op. And the training
stream's batches are put on the devices one batch ahead."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from runner import data
from runner.config.preprocessing import DEVICE_VALUE_RANGE, device_tail
from runner.data import pp_ops
from runner.evaluators.adversarial import AdversarialEvaluator
from runner.evaluators.fewshot import make_feature_fn
from runner.evaluators.predictions import make_predict_step
from runner.models import inputs
from runner.models.vit import VisionTransformer
from runner.parallel import Placement, make_mesh
from runner.train import objectives, optimizers, schedules
from runner.train.state import TrainState, abstract_params
from runner.train.step import make_eval_step, make_train_step

SPLIT = "validation"  # uci_digits: 179 examples of 8 x 8
ON_HOST = "|keep('image', 'label')"
RANGES = ["value_range(-1,1)", "value_range(0, 1)", "value_range(0.1, 0.7, 3, 250)",
          "value_range(vmin=-2, vmax=3, in_max=128)"]


@pytest.fixture(scope="module")
def uci(tfds_dir):
  return data.open_source("uci_digits", data_dir=str(tfds_dir))


def _eval(source, spec, batch_size=64):
  return list(data.eval_batches(source, SPLIT, spec, batch_size).as_numpy_iterator())


@pytest.mark.parametrize("value_range", RANGES)
def test_the_step_computes_what_the_host_op_computed(uci, value_range):
  spec = f"decode(3)|resize(6)|{value_range}"
  device, host = _eval(uci, spec), _eval(uci, spec + ON_HOST)
  assert len(device) == len(host) == 3  # 179 rows: the last batch padded
  for on_device, on_host in zip(device, host):
    assert on_device["image"].dtype == np.uint8 and on_host["image"].dtype == np.float32
    assert DEVICE_VALUE_RANGE not in on_host
    np.testing.assert_array_equal(on_device["_mask"], on_host["_mask"])
    images = np.asarray(jax.jit(inputs.images)(on_device))
    np.testing.assert_allclose(images, on_host["image"], rtol=0, atol=1e-6)
    assert not images[~on_device["_mask"]].any()  # padding rows stay zeros, not NaN


def test_the_training_stream_too(uci):
  spec = "decode(3)|pad(1)|random_crop(8)|flip_lr|value_range(-1,1)"
  device = next(data.train_batches(uci, SPLIT, spec, 32, seed=3))
  host = next(data.train_batches(uci, SPLIT, spec + ON_HOST, 32, seed=3))
  assert device["image"].dtype == np.uint8 and device[DEVICE_VALUE_RANGE].shape == (32, 4)
  np.testing.assert_allclose(np.asarray(inputs.images(device)), host["image"], atol=1e-6)


def test_against_tensorflows_op_on_every_pixel_value():
  """All 256 pixel values through the row the pipeline writes and through pp_ops' value_range."""
  pixels = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)
  for value_range in RANGES:
    tail = device_tail(f"decode|{value_range}")
    vmin, vmax, in_min, in_max = (tail[k] for k in ("vmin", "vmax", "in_min", "in_max"))
    row = np.asarray([[vmin, vmax - vmin, in_min, in_max - in_min]], np.float32)
    got = np.asarray(inputs.images({"image": pixels, DEVICE_VALUE_RANGE: row}))
    want = pp_ops.get_value_range(vmin, vmax, in_min, in_max)({"image": tf.constant(pixels)})
    np.testing.assert_allclose(got, want["image"].numpy(), rtol=0, atol=1e-6)


def test_float_images_stay_on_the_host_path(uci):
  """A corruption before value_range leaves float pixels: the whole spec runs on the host."""
  batch = _eval(uci, "decode(3)|corrupt('contrast', 2)|value_range(-1,1)")[0]
  assert batch["image"].dtype == np.float32 and DEVICE_VALUE_RANGE not in batch
  assert inputs.images(batch) is batch["image"]
  assert device_tail("decode(3)|value_range(-1,1)|keep('image')") is None
  assert device_tail("decode(3)|value_range(-1,1,key='other')")["key"] == "other"


# --- every function that reads a batch's images ---------------------------------------------

CLASSES = 10
MODEL = VisionTransformer(num_classes=CLASSES, patch_size=3, hidden_size=16, num_layers=2,
                          mlp_dim=32, num_heads=2, moe_layers=(1,),
                          moe=dict(num_experts=4, group_size=4, router=dict(k=2)))


@pytest.fixture(scope="module")
def batches(uci):
  """(the uint8 batch as the device gets it, the same batch with float images from the host)."""
  spec = "decode(3)|resize(6)|value_range(-1,1)"
  return _eval(uci, spec, 32)[0], _eval(uci, spec + ON_HOST, 32)[0]


@pytest.fixture(scope="module")
def params():
  shapes, _ = abstract_params(MODEL, (6, 6, 3))
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype), shapes)


def _same(fn, batches, **tolerance):
  on_device, on_host = (jax.device_get(fn(b)) for b in batches)
  for a, b in zip(jax.tree.leaves(on_device), jax.tree.leaves(on_host)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **(tolerance or {"atol": 1e-6}))


def test_eval_predict_and_feature_steps(batches, params):
  eval_step, predict = jax.jit(make_eval_step(MODEL)), jax.jit(make_predict_step(MODEL))
  features = jax.jit(make_feature_fn(MODEL))
  _same(lambda b: eval_step(params, b), batches, rtol=1e-5)
  _same(lambda b: predict(params, b), batches, rtol=1e-5, atol=1e-6)
  _same(lambda b: features(params, {k: b[k] for k in ("image", DEVICE_VALUE_RANGE) if k in b}),
        batches, rtol=1e-5, atol=1e-6)


def test_the_training_objective(batches, params):
  objective = objectives.classification(MODEL, loss="softmax_xent", aux_loss_weight=0.01)
  rngs = {"gating": jax.random.key(1), "dropout": jax.random.key(2)}
  loss = jax.jit(lambda b: jax.value_and_grad(
      lambda p: objective(p, b, rngs)[0])(params))
  _same(loss, batches, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_the_train_step(batches, params, accum_steps):
  """The step the loop runs, with the host's bookkeeping keys (`_mask`) in the batch: it takes
  them out, and must keep the uint8 images' value range (without it the model would train on
  raw pixels, 0 to 255)."""
  schedule = schedules.make_schedule("constant", 0.1, total_steps=10, warmup_steps=0)
  tx = optimizers.make_optimizer("sgd", schedule, params, momentum=0.0, grad_clip_norm=None)
  state = TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params))
  step = jax.jit(make_train_step(MODEL, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01,
                                 accum_steps=accum_steps))
  assert "_mask" in batches[0] and DEVICE_VALUE_RANGE in batches[0]
  _same(lambda b: step(state, b), batches, rtol=1e-5, atol=1e-6)


def test_pgd(batches, params):
  evaluator = AdversarialEvaluator(MODEL, epsilons=[0.0, 0.01], steps=2, prefix="pgd",
                                   progress=False)
  device, host = (evaluator.run(params, tf.data.Dataset.from_tensors(b)) for b in batches)
  assert device.keys() == host.keys()
  for k in device:
    assert device[k] == pytest.approx(host[k], rel=1e-5, abs=1e-6), k


def test_batches_are_put_on_the_devices_one_ahead():
  """The training loop's stream: every batch, in order, each put before the one before it is
  used (so that its copy overlaps that step), and never more than one ahead."""
  placement = Placement(make_mesh(jax.device_count()), ())
  taken = []

  def stream():
    for i in range(4):
      taken.append(i)
      yield {"image": np.full((jax.device_count(), 2), i, np.uint8)}
  ahead = placement.prefetch(stream())
  first = next(ahead)
  assert taken == [0, 1] and isinstance(first["image"], jax.Array)
  rest = list(ahead)
  assert [int(b["image"][0, 0]) for b in [first, *rest]] == [0, 1, 2, 3] and taken == [0, 1, 2, 3]
