"""`vmoe pretrain objective=contrastive`: two towers learn aligned image and text embeddings.

The image tower is `model` (any catalog model, without its head), the text tower `text.*`; the
data are image-caption pairs (`data.text_key`; by default the embedded MNIST digits with template
captions). With `init.checkpoint=<an image model's run>` the image tower starts from it and, with
`objective.lock_image` (the default), stays locked: LiT (Zhai et al. 2022). `model.head.type=
het_xl` adds HET-XL's noise to the representations (runner/models/contrastive.py). A trained
tokenizer (`text.tokenizer.*`) is written to the workdir for later stages. Validation: the loss,
in-batch retrieval accuracies, and zero-shot accuracy from class prompts (the embedded captions'
held-out templates) when the data has classes."""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import Callable

import jax
import numpy as np

from runner import data
from runner.checkpoints import weights
from runner.config.schema import ContrastiveLoss, TokenizerKind, TrainTask
from runner.data.captions import HELD_OUT_TEMPLATES
from runner.data.pipeline import TextSpec
from runner.data.tokenizers import MODEL_FILE, make_tokenizer
from runner.errors import ConfigError
from runner.evaluators.contrastive import PairEvaluator, make_pair_step, prompts
from runner.models.contrastive import build_two_towers
from runner.parallel import Placement
from runner.train import objectives, start as start_lib
from runner.train.loop import train_and_evaluate


@dataclasses.dataclass
class PairTraining:
  """What the training loop needs for image-text pairs."""
  objective: Callable  # runner/train/objectives.py contrastive_pairs
  text: TextSpec
  evaluator: Callable  # (batches, prefix, put) -> PairEvaluator
  frozen: str | None = None  # parameter names the optimizer leaves alone (LiT: the image tower)


def tokenizer(config: TrainTask, source: data.Source, split: str, workdir: str, *,
              resuming: bool, scratch: str):
  """The run's tokenizer (`train`: fitted on the training captions). A resumed run reuses the
  workdir's (its ids must not change); a fresh run trains one in `scratch`, which `keep_tokenizer`
  moves into the workdir once the run starts (a failed start leaves nothing a rerun could take)."""
  texts = source.captions(split) if config.text.tokenizer.kind == TokenizerKind.train else None
  return make_tokenizer(config.text.tokenizer, texts=texts,
                        workdir=workdir if resuming else scratch)


def keep_tokenizer(config: TrainTask, scratch: str) -> None:
  trained = os.path.join(scratch, MODEL_FILE)
  if config.text.tokenizer.kind == TokenizerKind.train and os.path.exists(trained):
    staged = os.path.join(config.workdir, f"{MODEL_FILE}.tmp{os.getpid()}")
    shutil.copyfile(trained, staged)
    os.replace(staged, os.path.join(config.workdir, MODEL_FILE))


def class_tokens(names: list[str] | None, templates, tok, max_length: int):
  """(C * T, L) tokens of every class prompt, class-major; None without class names."""
  if not names:
    return None
  return np.stack([tok.encode(p, max_length) for p in prompts(list(names), list(templates))])


def run(config: TrainTask, placement: Placement, stage: str, *, source: data.Source,
        resuming: bool, start: weights.Opened | None, fewshot, steps: int) -> dict:
  """Called by runner/training/run.py once the data (and few-shot datasets) are open and the
  run's `steps` checked; `start`: init.checkpoint, opened, when a new run starts from it."""
  if not source.text_key:
    raise ConfigError(f"objective=contrastive trains on image-caption pairs, but data="
                      f"{config.data.name} has no captions (data.text_key is not set); use "
                      "data=mnist5k_captions (embedded), data=captions data.root=<pairs.jsonl> or "
                      "data=coco_captions.")
  # Zero-shot validation: the data's class names in the held-out templates (or eval.zero_shot.*).
  zero_shot = config.eval.zero_shot
  if zero_shot.class_names and len(zero_shot.class_names) != source.num_classes:
    raise ConfigError(f"eval.zero_shot.class_names names {len(zero_shot.class_names)} classes, "
                      f"but data={config.data.name} has {source.num_classes}; name each of its "
                      "classes in label order, or leave the list empty for the data's own names.")
  templates = list(zero_shot.templates) or HELD_OUT_TEMPLATES
  locked = bool(config.init.checkpoint) and config.objective.lock_image
  with tempfile.TemporaryDirectory() as scratch:
    tok = tokenizer(config, source, config.data.split, config.workdir, resuming=resuming,
                    scratch=scratch)
    model = build_two_towers(config.model, config.text, config.objective, tok.vocab_size,
                             lock_image=locked)
    image_shape = data.image_shape(source, config.data.split, config.data.pp_train)
    begin = start_lib.towers(config, model, image_shape, start, stage, steps)
    if not resuming:
      keep_tokenizer(config, scratch)
  sigmoid = config.objective.loss == ContrastiveLoss.sigmoid
  pair_step = jax.jit(make_pair_step(model, sigmoid=sigmoid))
  tokens = class_tokens(list(zero_shot.class_names) or source.class_names, templates, tok,
                        config.text.max_length)
  pairs = PairTraining(
      objective=objectives.contrastive_pairs(model, loss=config.objective.loss.value,
                                             aux_loss_weight=config.train.aux_loss_weight),
      text=TextSpec(source.text_key, tok, config.text.max_length),
      evaluator=lambda batches, prefix, put: PairEvaluator(
          pair_step, batches, prefix=prefix, put=put, model=model, class_tokens=tokens,
          num_templates=len(templates)),
      frozen="image/.*" if locked else None)
  return train_and_evaluate(config, start=begin, source=source, placement=placement, stage=stage,
                            fewshot_datasets=fewshot, pairs=pairs)
