"""Zero-shot classification of a contrastive model against NumPy: the classifier's logits
(t · normalised image embedding · class embeddings), prompt ensembling in chunks, what a
prediction costs, the class names it takes, and the prompt templates' check."""
from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config.schema import ModelConfig, ObjectiveConfig, TextConfig, TokenizerConfig
from runner.config.validate import field_problems
from runner.data.tokenizers import make_tokenizer
from runner.errors import ConfigError
from runner.evaluators.contrastive import ZeroShotConfig, _is_template
from runner.models import model_config
from runner.inference import zero_shot
from runner.train import state as state_lib

IMAGE = (16, 16, 3)
EMBED = 8


def _image_config(name="vmoe_tiny") -> ModelConfig:
  c = model_config(name)
  return dataclasses.replace(c, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2,
                             image_size=16)


def _spec(names, templates=("a {}.", "the {} here."), image="vmoe_tiny", **objective):
  text = TextConfig(width=16, depth=1, mlp_dim=32, num_heads=2, max_length=12)
  tok = make_tokenizer(TokenizerConfig())
  spec = zero_shot.ZeroShot(text=text, objective=ObjectiveConfig(embedding_dim=EMBED,
                                                                 **objective),
                            tokenizer=tok, class_names=list(names), templates=list(templates))
  return spec, _image_config(image)


def _towers_params(spec, image, seed=0):
  params, _ = state_lib.init_params(spec.towers(image), IMAGE, seed)
  return jax.tree.map(np.asarray, params)


def _normalize(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_logits_are_the_scaled_cosine_to_each_class():
  spec, image = _spec(["cat", "dog", "eel"])
  towers = _towers_params(spec, image)
  towers["log_temperature"] = np.asarray(np.log(7.0), np.float32)
  rng = np.random.default_rng(0)
  classes = _normalize(rng.standard_normal((3, EMBED))).astype(np.float32)
  model = spec.model(image)
  images = rng.uniform(-1, 1, (4, *IMAGE)).astype(np.float32)
  logits, extras = model.apply({"params": {"towers": towers, "classes": classes}}, images)
  # NumPy: the image tower's pre-logits through the projection, normalised, against the classes.
  proj = towers["image_projection"]
  z = _normalize(np.asarray(extras["pre_logits"], np.float64) @ proj["kernel"] + proj["bias"])
  np.testing.assert_allclose(np.asarray(logits), 7.0 * z @ classes.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(extras["embedding"]), z, rtol=1e-5, atol=1e-6)
  assert float(extras["temperature"]) == pytest.approx(7.0, rel=1e-6)
  assert set(extras["routing"]) == {"layer_1"}  # the image tower's MoE layer, as a classifier's


def test_parameters_are_the_checkpoints_plus_the_classes():
  """A contrastive checkpoint's parameters, untouched, fill `towers`: the classifier's abstract
  tree is the two towers' and (C, E) classes."""
  spec, image = _spec(["a", "b"], loss="sigmoid")
  abstract, _ = state_lib.abstract_params(spec.model(image), IMAGE)
  towers = _towers_params(spec, image)
  assert jax.tree.map(np.shape, abstract["towers"]) == jax.tree.map(np.shape, towers)
  assert abstract["classes"].shape == (2, EMBED)
  assert set(abstract) == {"towers", "classes"}
  kept = spec.per_image({"towers": towers, "classes": np.zeros((2, EMBED))})
  assert "text" not in kept["towers"] and "text_projection" not in kept["towers"]
  assert {"image", "image_projection", "log_temperature", "bias"} <= set(kept["towers"])


def test_class_embeddings_are_normalised_prompt_means_in_any_chunking(monkeypatch):
  names = ["zero", "one", "two", "three", "four"]
  templates = ["a {}.", "the digit {}", "{}!"]
  spec, image = _spec(names, templates)
  towers_model = spec.towers(image)
  params = _towers_params(spec, image, seed=3)
  whole = zero_shot.embed_classes(towers_model, params, names, templates, spec.tokenizer, 12)
  # NumPy: every prompt's text embedding, averaged per class, normalised again.
  tokens = np.stack([spec.tokenizer.encode(t.format(n), 12) for n in names for t in templates])
  _, extras = towers_model.apply({"params": params}, None, jnp.asarray(tokens))
  text = np.asarray(extras["text_embedding"], np.float64).reshape(len(names), len(templates), -1)
  want = _normalize(text.mean(1))
  np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-6)
  monkeypatch.setattr(zero_shot, "PROMPTS_PER_CALL", 6)  # 2 classes a call: 3 calls, one padded
  chunked = zero_shot.embed_classes(towers_model, params, names, templates, spec.tokenizer, 12)
  np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-6)
  assert zero_shot.embed_classes(towers_model, params, [], templates, spec.tokenizer,
                                 12).shape == (0, EMBED)


def test_flops_are_the_image_tower_projection_and_classes():
  from runner.models import flops as flops_lib
  spec, image = _spec(["a", "b", "c"])
  tower = flops_lib.forward_flops_per_image(image, 0, batch_size=8, train=False)
  assert spec.flops_per_image(image, 8) == tower + 2.0 * 32 * EMBED + 2.0 * EMBED * 3
  het = dataclasses.replace(image, head=dataclasses.replace(image.head, type="het_xl"))
  assert spec.flops_per_image(het, 8) == spec.flops_per_image(image, 8)  # no noise at test


def _first(num_classes, names=None):
  source = types.SimpleNamespace(num_classes=num_classes, class_names=names)
  return types.SimpleNamespace(name="ds", source=source)


def _config(class_names=(), retrieval=False, **eval_keys):
  e = types.SimpleNamespace(zero_shot=ZeroShotConfig(class_names=list(class_names)),
                            retrieval=retrieval, save_predictions=False, ood_datasets=[],
                            corruptions=[], adversarial=types.SimpleNamespace(epsilons=[]),
                            capacity_sweep=[], routing_analysis=False)
  vars(e).update(eval_keys)
  return types.SimpleNamespace(eval=e)


def test_class_names_given_or_the_datasets_own():
  assert zero_shot.class_names(_config(), _first(2, ["cat", "dog"])) == ["cat", "dog"]
  assert zero_shot.class_names(_config(["kitten", "puppy"]), _first(2, ["cat", "dog"])) == [
      "kitten", "puppy"]
  with pytest.raises(ConfigError, match=r"names 3 classes, but eval dataset 'ds' has 2 \(cat, dog"):
    zero_shot.class_names(_config(["a", "b", "c"]), _first(2, ["cat", "dog"]))
  with pytest.raises(ConfigError, match=r"2 classes without names.*class_names=\[cat,dog"):
    zero_shot.class_names(_config(), _first(2))
  # captions without labels: retrieval alone, or nothing
  assert zero_shot.class_names(_config(retrieval=True), _first(0)) == []
  with pytest.raises(ConfigError, match="no labels.*eval.retrieval=true"):
    zero_shot.class_names(_config(), _first(0))
  with pytest.raises(ConfigError, match=r"only what needs no labels \(eval.retrieval=true\).*"
                     "eval.ood_datasets, eval.save_predictions"):
    zero_shot.class_names(_config(retrieval=True, ood_datasets=["x"], save_predictions=True),
                          _first(0))


@pytest.mark.parametrize("text, ok", [
    ("a photo of a {}.", True), ("{}", True), ("a photo", False), ("a {} and a {}", False),
    ("a {0}", False), ("a {name}", False), ("{} {x}", False), ("a {} {{braces}}", True),
])
def test_templates_need_one_slot_for_the_name(text, ok):
  assert _is_template(text) is ok
  problems = field_problems(ZeroShotConfig(templates=[text]), "eval.zero_shot.")
  assert (problems == []) is ok
  if not ok:
    assert "a prompt with one {} where the class name goes" in problems[0]


def test_class_names_are_non_empty_and_unique():
  assert field_problems(ZeroShotConfig(class_names=["a", " "]))
  assert "twice" in field_problems(ZeroShotConfig(class_names=["a", "a"]))[0]
