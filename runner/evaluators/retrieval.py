"""Image-text retrieval of a contrastive checkpoint (`eval.retrieval=true`): image->text and
text->image recall@1/5/10 over a whole eval split, each image paired with its first caption. Ranked
block by block on the host (runner/evaluators/contrastive.py `recall_at_k`): never N x N at once."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from runner.data.pipeline import TextSpec
from runner.errors import ConfigError
from runner.evaluators import predictions, suite as suite_lib
from runner.evaluators.contrastive import recall_at_k
from runner.models import inputs


def make_embed_step(towers):
  """(towers' params, batch with image and tokens) -> normalised image and text embeddings."""
  def step(params, batch):
    image, extras = towers.apply({"params": params}, inputs.images(batch), batch["tokens"],
                                 train=False)
    return {"image": image, "text": extras["text_embedding"]}
  return step


def embed_pairs(step, params, batches, put=lambda b: b) -> tuple[np.ndarray, np.ndarray]:
  """(N, E) image and (N, E) text embeddings of the real pairs of `batches`, in order."""
  images, texts = [], []
  for batch in batches.as_numpy_iterator():
    out = predictions.to_host(step(params, put(batch)))
    mask = np.asarray(predictions.to_host({"m": batch["_mask"]})["m"], bool)
    images.append(out["image"][mask])
    texts.append(out["text"][mask])
  return np.concatenate(images), np.concatenate(texts)


def require_captions(text_keys: dict[str, str | None]) -> None:
  """Raises unless one of the eval datasets (name -> its caption feature) has captions."""
  if not any(text_keys.values()):
    names = ", ".join(repr(name) for name in text_keys)
    raise ConfigError(
        f"eval.retrieval=true needs image-caption pairs, but eval dataset {names} has no "
        "captions (no data.text_key); evaluate a captioned dataset, e.g. "
        "eval.datasets=[mnist5k_captions], data=captions data.root=<pairs.jsonl>, or "
        "coco_captions.")


@dataclasses.dataclass
class RetrievalKeys:
  retrieval: bool = False  # contrastive: image->text and text->image recall@1/5/10


class Evaluator(suite_lib.Evaluator):
  name = "retrieval"
  enabling_key = "eval.retrieval"
  Keys = RetrievalKeys
  in_training = False  # a contrastive run's validation measures in-batch retrieval itself
  on_classifier = False  # ranks captions by a contrastive model's text tower
  needs_labels = False

  def __init__(self, suite: suite_lib.Suite):
    super().__init__(suite)
    members = suite.members
    zero_shot = [c.zero_shot for c in members.checkpoints] if members is not None else []
    if len(zero_shot) != 1 or zero_shot[0] is None:
      raise ConfigError("eval.retrieval=true ranks captions by a contrastive model's text "
                        "tower: evaluate one checkpoint of vmoe pretrain objective=contrastive.")
    self.pairs = [ds for ds in suite.datasets if ds.source.text_key]
    require_captions({ds.name: ds.source.text_key for ds in suite.datasets})
    self.spec = zero_shot[0]

  @classmethod
  def check_datasets(cls, config, datasets) -> None:
    require_captions({name: d.text_key for name, d in datasets.items()})

  def run(self) -> suite_lib.Result:
    s, spec = self.suite, self.spec
    step = jax.jit(make_embed_step(spec.towers(s.members.checkpoints[0].config)))
    summary = {}
    for ds in self.pairs:
      text = TextSpec(ds.source.text_key, spec.tokenizer, spec.text.max_length)
      images, texts = embed_pairs(step, s.params["towers"], s.batches(ds, text=text),
                                  put=s.placement.put)
      recalls = recall_at_k(images, texts)
      summary.update({f"{ds.name}/{k}": v for k, v in recalls.items()})
      summary[f"{ds.name}/retrieval_pairs"] = len(images)
      s.say(f"[eval] retrieval on {ds.name}/{ds.split}: {len(images)} pairs, i2t recall@1 "
            f"{recalls['i2t_recall@1']:.3f}, t2i recall@1 {recalls['t2i_recall@1']:.3f}")
    return suite_lib.Result(summary=summary)
