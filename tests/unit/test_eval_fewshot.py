"""Few-shot evaluation around the math: feature streaming over padded batches, concatenation of
extractors, evaluator keys, report helpers, model overrides and the dataset checks."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from omegaconf import OmegaConf

from runner import parallel
from runner.config import as_dict, derived, sections, validate
from runner.config.resolve import (checkpoint_paths, fewshot_run, model_overrides,
                                   stored_model_and_data)
from runner.config.schema import (DataConfig, DistributedConfig, FewshotConfig, FewshotMember,
                                  FewshotRun, FewshotTask, LoggerConfig, MeshConfig, MoeConfig,
                                  RouterConfig, ShardingConfig)
from runner.errors import ConfigError
from runner.evaluators import fewshot_math
from runner.evaluators.fewshot import (FewshotEvaluator, accuracy_table, extract_features,
                                       format_table, make_feature_fn, plot_accuracy_vs_shots)
from runner.models import build_model, catalog
from runner.datasets import fewshot_data


def _padded_batches(images, labels, num_classes, batch_size):
  """Batches as data.eval_batches makes them: full size, one-hot labels, `_mask`, zero padding."""
  out = []
  for start in range(0, len(images), batch_size):
    x, y = images[start:start + batch_size], labels[start:start + batch_size]
    pad = batch_size - len(x)
    out.append({"image": np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]),
                "labels": np.concatenate([np.eye(num_classes, dtype=np.float32)[y],
                                          np.zeros((pad, num_classes), np.float32)]),
                "_mask": np.arange(batch_size) < len(x)})
  return out


def _first(batch):
  images = batch["image"]
  return jnp.reshape(images, (images.shape[0], -1))[:, :3] * 2.0


def _second(batch):
  return jnp.mean(batch["image"], axis=(1, 2))  # (B, C)


@pytest.fixture
def digits():
  rng = np.random.default_rng(0)
  images = rng.normal(size=(13, 4, 4, 2)).astype(np.float32)
  labels = rng.integers(3, size=13)
  return images, labels


def test_padding_rows_are_dropped_and_labels_come_from_one_hot(digits):
  images, labels = digits
  batches = _padded_batches(images, labels, 3, batch_size=5)  # 13 = 5 + 5 + 3 real rows
  assert (~batches[-1]["_mask"]).sum() == 2
  features, got_labels = extract_features([jax.jit(_first)], batches)
  np.testing.assert_allclose(features, images.reshape(13, -1)[:, :3] * 2.0, rtol=1e-6)
  np.testing.assert_array_equal(got_labels, labels)
  assert features.dtype == np.float32 and got_labels.dtype == np.int64


def test_two_extractors_concatenate_like_hstack(digits):
  images, labels = digits
  batches = _padded_batches(images, labels, 3, batch_size=4)
  one, _ = extract_features([jax.jit(_first)], batches)
  two, _ = extract_features([jax.jit(_second)], batches)
  both, got_labels = extract_features([jax.jit(_first), jax.jit(_second)], batches)
  np.testing.assert_array_equal(both, np.hstack([one, two]))
  assert both.shape == (13, 3 + 2)
  np.testing.assert_array_equal(got_labels, labels)


def test_tf_data_batches_and_a_device_placement(digits):
  """A re-iterable tf.data dataset (as eval_batches returns) placed with a real Placement."""
  images, labels = digits
  batches = _padded_batches(images, labels, 3, batch_size=4)
  ds = tf.data.Dataset.from_tensor_slices(
      {k: np.stack([b[k] for b in batches]) for k in batches[0]})
  placement = parallel.placement(rules=parallel.logical_rules("dp"))
  with placement.context():
    features, got_labels = extract_features([jax.jit(_first)], ds, placement.put)
  np.testing.assert_allclose(features, images.reshape(13, -1)[:, :3] * 2.0, rtol=1e-6)
  np.testing.assert_array_equal(got_labels, labels)
  again, _ = extract_features([jax.jit(_first)], ds)  # the dataset can be read again
  np.testing.assert_array_equal(again, features)


def test_no_batches_and_no_extractors():
  features, labels = extract_features([_first], [])
  assert features.shape[0] == 0 and labels.shape == (0,)
  with pytest.raises(ValueError, match="at least one feature function"):
    extract_features([], [])


def _clusters(seed, num_classes, per_class, dim=4):
  """Images whose mean pixel is a well-separated class centre: linearly separable features."""
  rng = np.random.default_rng(seed)
  labels = np.repeat(np.arange(num_classes), per_class)
  rng.shuffle(labels)
  centres = 10.0 * np.eye(num_classes, dim)
  pixels = centres[labels][:, None, None, :] + 0.1 * rng.normal(size=(len(labels), 2, 2, dim))
  return pixels.astype(np.float32), labels


def _dataset(seed, num_classes, per_class=6, batch_size=8):
  train = _clusters(seed, num_classes, per_class)
  test = _clusters(seed + 100, num_classes, 3)
  return (_padded_batches(*train, num_classes, batch_size),
          _padded_batches(*test, num_classes, batch_size), num_classes)


def test_evaluator_keys_and_accuracy_on_separable_data():
  datasets = {"a": _dataset(0, 3), "b": _dataset(1, 4)}
  evaluator = FewshotEvaluator([jax.jit(_second)], datasets, shots=[1, 5], seeds=[0, 1],
                               protocol="plain")
  metrics = evaluator.run()
  expected = {f"{n}/{s}shot/accuracy" for n in ("a", "b", "mean") for s in (1, 5)}
  expected |= {"mean/1shot/l2_reg", "mean/5shot/l2_reg", "seconds"}
  assert set(metrics) == expected
  for key in expected - {"mean/1shot/l2_reg", "mean/5shot/l2_reg", "seconds"}:
    assert metrics[key] == 1.0, key
  assert metrics["mean/5shot/l2_reg"] in fewshot_math.L2_REGS
  # The reference protocol standardises every dimension by the shots' std: dataset "a" has 3
  # classes in 4 channels, one of them pure noise, which 1 shot per class scales up to the
  # informative ones. 5 shots are enough.
  reference = FewshotEvaluator([jax.jit(_second)], datasets, shots=[1, 5], seeds=[0, 1]).run()
  assert set(reference) == expected
  assert reference["a/5shot/accuracy"] == reference["b/5shot/accuracy"] == 1.0
  assert reference["b/1shot/accuracy"] == 1.0 and reference["a/1shot/accuracy"] < 1.0


def test_evaluator_equals_fewshot_metrics_on_extracted_features():
  datasets = {"a": _dataset(2, 3), "b": _dataset(3, 2)}
  fns = [jax.jit(_first), jax.jit(_second)]
  evaluator = FewshotEvaluator(fns, datasets, shots=[2, 4], seeds=[0], l2_regs=[0.1, 1.0, 10.0])
  features = {}
  for name, (train, test, c) in datasets.items():
    features[name] = (*extract_features(fns, train), *extract_features(fns, test), c)
  want = fewshot_math.fewshot_metrics(features, [2, 4], [0], [0.1, 1.0, 10.0])
  got = evaluator.run()
  got.pop("seconds")
  assert got == want
  assert evaluator.protocol == "reference"  # the default: the reference code's protocol
  from runner.config.schema import FewshotProtocol
  plain = FewshotEvaluator(fns, datasets, shots=[2, 4], seeds=[0], l2_regs=[0.1, 1.0, 10.0],
                           protocol=FewshotProtocol.plain)  # the config's enum is accepted
  got = plain.run()
  got.pop("seconds")
  assert got == fewshot_math.fewshot_metrics(features, [2, 4], [0], [0.1, 1.0, 10.0],
                                             protocol="plain")


def test_prefix_and_feature_fns_given_at_run_time():
  datasets = {"a": _dataset(4, 3)}
  evaluator = FewshotEvaluator(None, datasets, shots=[1], seeds=[0], prefix="fewshot")
  metrics = evaluator.run([jax.jit(_second)])
  assert set(metrics) == {"fewshot/a/1shot/accuracy", "fewshot/mean/1shot/accuracy",
                          "fewshot/mean/1shot/l2_reg", "fewshot/seconds"}
  zero = evaluator.run([jax.jit(lambda b: jnp.zeros((b["image"].shape[0], 2)))])
  assert zero["fewshot/a/1shot/accuracy"] < metrics["fewshot/a/1shot/accuracy"]


def test_shots_beyond_the_smallest_class_fail_clearly():
  evaluator = FewshotEvaluator([jax.jit(_second)], {"a": _dataset(5, 3, per_class=2)}, shots=[3],
                               seeds=[0])
  with pytest.raises(fewshot_math.FewShotError, match="'a', 3 shots: class 0 has 2"):
    evaluator.run()


def test_feature_fn_returns_the_models_pre_logits():
  cfg = dataclasses.replace(catalog.model_config("vit_tiny"), image_size=8, hidden_size=16,
                            num_layers=1, mlp_dim=32, num_heads=2, representation_size=12)
  model = build_model(cfg, num_classes=5)
  images = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8, 8, 3)), jnp.float32)
  params = model.init(jax.random.key(0), images, train=False)["params"]
  features = jax.jit(make_feature_fn(model))(params, {"image": images})
  _, extras = model.apply({"params": params}, images, train=False)
  assert features.shape == (3, 12)
  np.testing.assert_allclose(features, extras["pre_logits"], rtol=1e-5, atol=1e-6)


METRICS = {"a/1shot/accuracy": 0.5, "a/5shot/accuracy": 0.75, "b/1shot/accuracy": 0.25,
           "b/5shot/accuracy": 0.5, "mean/1shot/accuracy": 0.375, "mean/5shot/accuracy": 0.625,
           "mean/1shot/l2_reg": 1.0, "seconds": 3.0}


def test_accuracy_table_and_text():
  names, shots, table = accuracy_table(METRICS)
  assert names == ["a", "b", "mean"] and shots == [1, 5]
  np.testing.assert_array_equal(table, [[0.5, 0.75], [0.25, 0.5], [0.375, 0.625]])
  text = format_table(METRICS).splitlines()
  assert text[0].split() == ["dataset", "1-shot", "5-shot"]
  assert text[3].split() == ["mean", "0.3750", "0.6250"]


def test_plot_writes_a_png(tmp_path):
  path = plot_accuracy_vs_shots(METRICS, str(tmp_path / "fs.png"), title="t")
  assert (tmp_path / "fs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.endswith("fs.png")


def _stored(**model):
  """A checkpoint's stored config (plain values, as read from its config.yaml): every key of
  vmoe_tiny, the given ones (sections merged key by key) on top."""
  full = as_dict(catalog.model_config("vmoe_tiny"))
  for name, value in model.items():
    full[name] = {**full[name], **value} if isinstance(value, dict) else value
  return {"model": full, "data": {"name": "uci_digits", "pp": "decode(3)|resize(16)"}}


def test_model_overrides_on_the_stored_model():
  stored = _stored(hidden_size=32, moe={"layers": [1], "num_experts": 8},
                   router={"k": 2, "capacity_ratio": 1.05, "eval_capacity_ratio": None})
  given = {"name": None, "hidden_size": None, "moe": {"layers": None, "num_experts": None},
           "router": {"k": 1, "capacity_ratio": 0.5, "eval_capacity_ratio": None}}
  # None means "unchanged"; a given capacity_ratio is also the inference one (the stored model
  # has MoE layers and a token-choice router, whose capacity may change at inference) ...
  assert model_overrides(given, stored["model"]) == {
      "router": {"k": 1, "capacity_ratio": 0.5, "eval_capacity_ratio": 0.5}}
  assert model_overrides(None) == {}
  # ... but not for Soft MoE (its slots are parameters) nor for a dense ViT (no capacity).
  soft = {**stored["model"], "router": {**stored["model"]["router"], "type": "soft"}}
  dense = {**stored["model"], "moe": {**stored["model"]["moe"], "layers": []}}
  for other in (soft, dense):
    assert model_overrides(given, other) == {"router": {"k": 1, "capacity_ratio": 0.5}}
  model, data = stored_model_and_data(stored, given)
  assert model.router == sections.new(RouterConfig, k=1, capacity_ratio=0.5, eval_capacity_ratio=0.5)
  assert model.hidden_size == 32 and model.moe == MoeConfig(layers=[1], num_experts=8)
  assert model.name == "vmoe_tiny" and model.num_heads == 4
  assert data.pp == "decode(3)|resize(16)"
  assert stored["model"]["router"]["k"] == 2  # the stored config is not changed
  assert given["router"]["eval_capacity_ratio"] is None
  unchanged, _ = stored_model_and_data(stored, None)
  assert as_dict(unchanged) == stored["model"]
  # An explicit eval_capacity_ratio wins over the given capacity_ratio.
  explicit, _ = stored_model_and_data(stored, {"router": {"capacity_ratio": 0.5,
                                                          "eval_capacity_ratio": 2.0}})
  assert (explicit.router.capacity_ratio, explicit.router.eval_capacity_ratio) == (0.5, 2.0)
  # Keys a checkpoint of an older version stored, which the schema no longer has, are ignored.
  old, _ = stored_model_and_data(_stored(retired_key=1), None)
  assert old == catalog.model_config("vmoe_tiny")


def _fewshot_run(stored_by_path: dict, **fewshot):
  """What `vmoe fewshot` resolves: init.checkpoint's stored configs, fewshot.* on top."""
  cfg = OmegaConf.merge(OmegaConf.structured(FewshotTask),
                        {"workdir": "/tmp/w", "fewshot": {"datasets": ["uci_digits"], **fewshot}})
  return fewshot_run(cfg, "/tmp/w", stored_by_path)


def test_checkpoint_paths_and_shared_preprocessing():
  assert checkpoint_paths("runs/a") == ["runs/a"]
  assert checkpoint_paths(["runs/a", "runs/b"]) == ["runs/a", "runs/b"]
  for missing in (None, "", []):
    with pytest.raises(ConfigError, match="needs init.checkpoint"):
      checkpoint_paths(missing)
  same = _stored()
  run = validate(_fewshot_run({"a": same, "b": same}))
  assert [m.path for m in run.members] == ["a", "b"]
  assert run.data == DataConfig(name="uci_digits", pp="decode(3)|resize(16)")
  other = {**same, "data": {"name": "uci_digits", "pp": "decode(3)|resize(24)"}}
  with pytest.raises(ConfigError, match="preprocess images differently.*resize\\(24\\)"):
    validate(_fewshot_run({"a": same, "b": other}))


def test_pool_split_prefers_the_datasets_own_train_slice():
  sliced, whole = DataConfig(name="x", split="train[:98%]"), DataConfig(name="x", split="train")
  assert fewshot_data.pool_split(sliced, "train") == "train[:98%]"
  assert fewshot_data.pool_split(whole, "train") == "train"
  assert fewshot_data.pool_split(sliced, "validation") == "validation"


def _run_with(fewshot: FewshotConfig) -> FewshotRun:
  member = FewshotMember(path="runs/a", model=catalog.model_config("vit_tiny"),
                         data=DataConfig(name="uci_digits"))
  return FewshotRun(seed=0, workdir="/tmp/w", debug=False, members=[member], data=member.data,
                    fewshot=fewshot, logger=LoggerConfig(), mesh=MeshConfig(),
                    sharding=ShardingConfig(), distributed=DistributedConfig())


@pytest.mark.parametrize("change, expected", [
    ({"datasets": []}, "fewshot.datasets is empty"),
    ({"shots": [0, 5]}, r"fewshot.shots=\[0, 5\] has the item 0, which must be >= 1"),
    ({"shots": []}, r"fewshot.shots=\[\] must be a non-empty list"),
    ({"seeds": []}, r"fewshot.seeds=\[\] must be a non-empty list"),
    ({"l2_regs": [1.0, 0.1]}, r"fewshot.l2_regs=\[1.0, 0.1\] must be strictly increasing"),
    ({"l2_regs": [0.0, 1.0]}, r"fewshot.l2_regs=.* has the item 0.0, which must be > 0"),
    ({"max_train_examples": 0}, "fewshot.max_train_examples=0 must be >= 1"),
    ({"batch_size": 0}, "fewshot.batch_size=0 must be >= 1"),
    ({"datasets": ["uci_digits", "uci_digits"]}, "fewshot.datasets=.* names an item twice"),
])
def test_bad_fewshot_config(change, expected):
  config = dict(datasets=["uci_digits"], shots=[1, 5], seeds=[0], l2_regs=None,
                max_train_examples=None, batch_size=None)
  validate(_run_with(FewshotConfig(**config)))  # the base is valid
  with pytest.raises(ConfigError, match=expected):
    validate(_run_with(FewshotConfig(**{**config, **change})))


def test_training_enables_fewshot_only_with_steps_and_datasets():
  assert derived.fewshot_in_training(FewshotConfig(every_steps=5, datasets=["a"]))
  assert not derived.fewshot_in_training(FewshotConfig(every_steps=0, datasets=["a"]))
  assert not derived.fewshot_in_training(FewshotConfig(every_steps=5, datasets=[]))
  assert not derived.fewshot_in_training(FewshotConfig())


def test_fewshot_batch_size_falls_back_to_the_evaluation_batch():
  data = DataConfig(name="x", batch_size=64, eval_batch_size=None)
  assert derived.fewshot_batch_size(FewshotConfig(batch_size=16), data, 32) == 16
  assert derived.fewshot_batch_size(FewshotConfig(), data, 32) == 32
  with_eval = dataclasses.replace(data, eval_batch_size=48)
  assert derived.fewshot_batch_size(FewshotConfig(), with_eval) == 48
  assert derived.fewshot_batch_size(FewshotConfig(), data) == 64
