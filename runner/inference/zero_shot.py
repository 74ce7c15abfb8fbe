"""`vmoe eval` of a contrastive checkpoint: its two towers as a zero-shot classifier
(docs/contrastive.md), one member of `Members` like any checkpoint, so that every measurement that
declares `on_contrastive` applies. A dataset of captions without labels can only be measured by
the evaluators that declare they need no labels, which then run alone. Everything is checked
before any compute: the class names, the tokenizer the run wrote, and that the parameters fit."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from runner import data
from runner.checkpoints import checkpoint, weights
from runner.config import derived
from runner.config.schema import HeadType, ModelConfig, ObjectiveConfig, TextConfig, TokenizerKind
from runner.data.captions import HELD_OUT_TEMPLATES
from runner.data.tokenizers import MODEL_FILE, Tokenizer, make_tokenizer
from runner.errors import ConfigError
from runner.evaluators import EVALUATORS, suite as suite_lib
from runner.evaluators.contrastive import class_embeddings, prompts
from runner.models import flops as flops_lib
from runner.models.contrastive import build_two_towers
from runner.models.zero_shot import ZeroShotClassifier
from runner.datasets import dataset_specs
from runner.inference.members import Checkpoint, Members
from runner.logging import say
from runner.stages import setup

PROMPTS_PER_CALL = 4096  # prompts the text tower embeds at once


def _runs_without_labels() -> list[type[suite_lib.Evaluator]]:
  """The evaluators that measure a contrastive checkpoint on captions without labels."""
  return [cls for _, cls in EVALUATORS.items() if cls.on_contrastive and not cls.needs_labels]


@dataclasses.dataclass
class ZeroShot:
  """What makes a contrastive checkpoint a classifier: text tower, tokenizer, classes, prompts."""
  text: TextConfig
  objective: ObjectiveConfig
  tokenizer: Tokenizer
  class_names: list[str]
  templates: list[str]

  @property
  def num_classes(self) -> int:
    return len(self.class_names)

  def towers(self, image: ModelConfig):
    """The two towers with `image` (the stored model, with any inference changes) as the image
    tower, as training built them (never locked: evaluation trains nothing)."""
    return build_two_towers(image, self.text, self.objective, self.tokenizer.vocab_size)

  def model(self, image: ModelConfig) -> ZeroShotClassifier:
    return ZeroShotClassifier(self.towers(image), self.num_classes, self.objective.embedding_dim)

  @staticmethod
  def per_image(params: dict) -> dict:
    """The parameters an image's prediction uses: all but the text tower's (which ran once, for
    the class embeddings) and HET-XL's training noise."""
    towers = {k: v for k, v in params["towers"].items()
              if k not in ("text", "text_projection", "image_noise", "text_noise")}
    return {"towers": towers, "classes": params["classes"]}

  def flops_per_image(self, image: ModelConfig, batch_size: int) -> float:
    """The image tower (without a head), its projection, and the similarities to the classes."""
    plain = dataclasses.replace(image, head=dataclasses.replace(image.head, type=HeadType.det))
    tower = flops_lib.forward_flops_per_image(plain, 0, batch_size=batch_size, train=False)
    width = derived.pre_logits_width(image) * derived.predictions_per_image(image)
    e = self.objective.embedding_dim
    return tower + 2.0 * width * e + 2.0 * e * self.num_classes


def tokenizer(config, opened: weights.Opened) -> Tokenizer:
  """The tokenizer the contrastive run used; a trained one is read from the run's workdir."""
  path, run_dir = opened.path, opened.directory.parent
  tok = config.text.tokenizer
  if tok.kind == TokenizerKind.train and not (run_dir / MODEL_FILE).is_file():
    raise checkpoint.CheckpointError(
        f"init.checkpoint={path} was trained with text.tokenizer.kind=train, but the tokenizer "
        f"it trained, {run_dir / MODEL_FILE}, is missing: the run writes it next to its "
        "checkpoints/ folder; copy it there with the checkpoints.")
  try:
    return make_tokenizer(tok, workdir=str(run_dir))
  except data.DataError as e:
    raise data.DataError(f"the tokenizer of init.checkpoint={path}: {e}") from None


def class_names(config, first: suite_lib.Dataset) -> list[str]:
  """eval.zero_shot.class_names, else the first eval dataset's own; [] on a dataset without labels
  (only the evaluators that need none run). ConfigError when there is nothing to classify with."""
  e, source = config.eval, first.source
  given = [str(n) for n in e.zero_shot.class_names]
  if not source.num_classes:
    label_free = _runs_without_labels()
    turn_on = " or ".join(  # the overrides that turn them on (`eval.<key>=true` for a switch)
        f"{cls.enabling_key}={'true' if isinstance(cls.setting(e), bool) else '[...]'}"
        for cls in label_free if cls.enabling_key)
    if not any(cls.enabled(e) for cls in label_free):
      raise ConfigError(
          f"eval dataset {first.name!r} has image-caption pairs but no labels, so a contrastive "
          "checkpoint cannot be scored on it zero-shot; measure what needs no labels on it "
          f"with {turn_on}, or classify a labelled dataset, e.g. eval.datasets=[mnist5k] "
          "(with eval.zero_shot.class_names=[...] where its labels have no names).")
    # The keys given that need labels (an evaluator always on that needs them just does not run).
    others = [cls.enabling_key for _, cls in EVALUATORS.items()
              if cls.needs_labels and cls.enabling_key and cls.enabled(e)]
    others += ["eval.save_predictions"] if e.save_predictions else []
    if given or others:
      what = ", ".join((["eval.zero_shot.class_names"] if given else []) + others)
      raise ConfigError(
          f"eval dataset {first.name!r} has no labels, so only what needs no labels ({turn_on}) "
          f"can be measured on it, but {what} asks for more; drop it, or evaluate a labelled "
          "dataset (eval.datasets=[...]).")
    return []
  if given:
    if len(given) != source.num_classes:
      known = f" ({', '.join(source.class_names)})" if source.class_names else ""
      raise ConfigError(
          f"eval.zero_shot.class_names names {len(given)} classes, but eval dataset {first.name!r} "
          f"has {source.num_classes}{known}; give one name per class, in the order of its labels.")
    return given
  if not source.class_names:
    raise ConfigError(
        f"zero-shot classification needs class names, and eval dataset {first.name!r} has "
        f"{source.num_classes} classes without names; give them in label order, "
        "eval.zero_shot.class_names=[cat,dog,...].")
  return [str(n) for n in source.class_names]


def embed_classes(towers, params, names: list[str], templates: list[str], tok: Tokenizer,
                  max_length: int) -> np.ndarray:
  """(C, E) class embeddings (prompt ensembling), the prompts embedded a chunk of classes at a
  time, every chunk of one shape (one compilation)."""
  if not names:
    return np.zeros((0, towers.embedding_dim), np.float32)
  t = len(templates)
  per_call = max(1, min(len(names), PROMPTS_PER_CALL // t))
  embed = jax.jit(lambda p, tokens: class_embeddings(towers, p, tokens, t))
  out = []
  for start in range(0, len(names), per_call):
    chunk = names[start:start + per_call]
    chunk = chunk + [chunk[-1]] * (per_call - len(chunk))
    tokens = np.stack([tok.encode(p, max_length) for p in prompts(chunk, templates)])
    out.append(np.asarray(jax.device_get(embed(params, tokens)), np.float32))
  return np.concatenate(out)[:len(names)]


def _warn_if_cut(names: list[str], templates: list[str], tok: Tokenizer, max_length: int) -> None:
  """Prompts longer than the text tower reads are cut (as training cut its captions): say so,
  since a cut that drops the class name makes that template the same for every class."""
  texts = prompts(names, templates)
  cut = sum(len(tok.ids(text)) > max_length - 1 for text in texts)
  if cut:
    say(f"warning: {cut} of {len(texts)} zero-shot prompts are longer than the "
        f"{max_length - 1} tokens the text tower reads (text.max_length={max_length} with its "
        "end token) and are cut; where the cut drops the class name, that prompt is the same "
        "for every class.")


def load(config, opened: weights.Opened) -> tuple[Members, tuple[str, ...], dict]:
  """(the checkpoint as a zero-shot classifier, the evaluators that may run on it (those the eval.*
  keys enable run), the summary's zero-shot entries) for the resolved eval run `config` of a
  contrastive run, whose init.checkpoint is `opened`."""
  e, path = config.eval, opened.path
  datasets = e.datasets or [config.data.name]
  enabled = [cls for _, cls in EVALUATORS.items() if cls.on_contrastive and cls.enabled(e)]
  if enabled:  # what they need of the datasets, before the class embeddings are computed
    configs = {name: dataset_specs.dataset_config(name, config.data) for name in datasets}
    for cls in enabled:
      cls.check_datasets(e, configs)
  first = dataset_specs.open_dataset(datasets[0], config.data, e.split)
  names = class_names(config, first)
  templates = [str(t) for t in e.zero_shot.templates] or list(HELD_OUT_TEMPLATES)
  tok = tokenizer(config, opened)
  params, _, step = opened.load(ensemble_size=derived.ensemble_size(config.model))
  spec = ZeroShot(text=config.text, objective=config.objective, tokenizer=tok, class_names=names,
                  templates=templates)
  towers = spec.towers(config.model)
  image_shape = data.image_shape(first.source, first.split, first.config.pp)
  setup.check_params_fit(path, step, params, towers, image_shape, "eval")
  _warn_if_cut(names, templates, tok, config.text.max_length)
  classes = embed_classes(towers, params, names, templates, tok, config.text.max_length)
  member = Checkpoint(path=path, step=step, config=config.model,
                      params={"towers": params, "classes": classes}, zero_shot=spec)
  summary = {"zero_shot/temperature": float(np.exp(np.asarray(params["log_temperature"])))}
  if names:
    summary.update({"zero_shot/num_classes": len(names), "zero_shot/class_names": names,
                    "zero_shot/templates": templates})
  runs = tuple(name for name, cls in EVALUATORS.items()
               if cls.on_contrastive and (names or not cls.needs_labels))
  return Members([member], output="softmax"), runs, summary
