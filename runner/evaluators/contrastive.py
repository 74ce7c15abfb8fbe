"""Evaluating image-text models: in-batch retrieval and loss, zero-shot classification from class
prompts, and retrieval recall@k over a whole split (docs/contrastive.md).

The class names and prompt templates are keys of their own, eval.zero_shot.*, declared here as a
section that only a contrastive checkpoint reads: zero-shot classification is no evaluator of its
own, but what makes such a checkpoint the classifier the evaluators measure."""
from __future__ import annotations

import dataclasses
from typing import List

import jax
import jax.numpy as jnp
import numpy as np

from runner.config.checks import Items, Rule, key, matches
from runner.config.relations import CONTRASTIVE_ONLY
from runner.config.schema import EvalSuiteConfig
from runner.config.sections import add_fields
from runner.evaluators.classification import ClassificationEvaluator
from runner.losses import contrastive
from runner.models import inputs
from runner.models.contrastive import normalize

RECALL_AT = (1, 5, 10)


def _is_template(text) -> bool:
  """A zero-shot prompt template: a string with exactly one `{}`, filled by str.format."""
  if not isinstance(text, str) or "{}" not in text:
    return False
  try:
    text.format("name")
  except (IndexError, KeyError, ValueError):
    return False
  return True


@dataclasses.dataclass
class ZeroShotConfig:
  """eval.zero_shot.*: classifying images by their similarity to class prompts (a contrastive
  checkpoint)."""
  class_names: List[str] = key([], Items(matches(r"(?s).*\S.*", "a non-empty name"),
                                         unique=True, example="[cat,dog]"),
                               "[]: the first eval dataset's own class names, in label order")
  templates: List[str] = key([], Items(Rule(_is_template, "a prompt with one {} where the class "
                                            "name goes"), example="['a photo of a {}.']"),
                             "[]: the templates held out from the embedded captions")


add_fields(EvalSuiteConfig, {"zero_shot": (ZeroShotConfig, dataclasses.field(
    default_factory=ZeroShotConfig, metadata={CONTRASTIVE_ONLY: True,
                                              "declared_by": f"{__name__}.ZeroShotConfig"}))},
           owner=f"{__name__}.ZeroShotConfig")


def prompts(class_names: list[str], templates: list[str]) -> list[str]:
  """Class-major: every template for class 0, then class 1, ..."""
  return [t.format(name) for name in class_names for t in templates]


def class_embeddings(model, params, tokens: np.ndarray, num_templates: int) -> jax.Array:
  """(C, E) normalised mean of each class's prompt embeddings; tokens (C * T, L), class-major."""
  _, extras = model.apply({"params": params}, None, jnp.asarray(tokens), train=False)
  z = extras["text_embedding"].reshape(-1, num_templates, extras["text_embedding"].shape[-1])
  return normalize(z.mean(axis=1))


def make_pair_step(model, *, sigmoid: bool):
  """(params, batch, classes) -> sums over the batch's real pairs (runner/losses/contrastive.py
  masked_sums), plus zero-shot correct predictions when `classes` (C, E) and labels are given."""
  def step(params, batch, classes):
    zimg, extras = model.apply({"params": params}, inputs.images(batch), batch["tokens"],
                               train=False)
    sums = contrastive.masked_sums(zimg, extras["text_embedding"], extras["temperature"],
                                   batch["_mask"], bias=extras.get("bias") if sigmoid else None)
    if classes is not None and "labels" in batch:
      predicted = jnp.argmax(zimg @ classes.T, axis=-1)
      correct = jnp.take_along_axis(batch["labels"], predicted[:, None], axis=1)[:, 0] > 0
      sums["zero_shot_prec@1"] = jnp.sum(correct * batch["_mask"])
    return sums
  return step


class PairEvaluator(ClassificationEvaluator):
  """The training loop's evaluation of a contrastive model on a split of pairs: the loss, the
  in-batch image->text and text->image accuracies, and zero-shot accuracy from class prompts
  (when the data has classes)."""

  def __init__(self, step, batches, *, prefix: str, put=lambda b: b, model=None,
               class_tokens: np.ndarray | None = None, num_templates: int = 1):
    super().__init__(step, batches, prefix=prefix, put=put)
    self.model, self.class_tokens, self.num_templates = model, class_tokens, num_templates
    self.embed = jax.jit(lambda p, t: class_embeddings(model, p, t, num_templates))

  def run(self, params) -> dict:
    classes = None if self.class_tokens is None else self.embed(params, self.class_tokens)
    return super().run(params, classes)


def recall_at_k(zimg: np.ndarray, ztxt: np.ndarray, ks=RECALL_AT, block: int = 1024) -> dict:
  """Image->text and text->image recall@k of N pairs (row n of each is the true partner),
  ranking by cosine similarity block by block (never all N x N similarities at once; ties count
  against the true partner)."""
  out = {}
  for name, queries, keys in (("i2t", zimg, ztxt), ("t2i", ztxt, zimg)):
    ranks = []
    for start in range(0, len(queries), block):
      q = queries[start:start + block]
      sims = q @ keys.T
      own = sims[np.arange(len(q)), np.arange(start, start + len(q))]
      ranks.append((sims >= own[:, None]).sum(1) - 1)  # keys at least as similar as the partner
    ranks = np.concatenate(ranks)
    out.update({f"{name}_recall@{k}": float(np.mean(ranks < k)) for k in ks})
  return out
