"""Captions to token ids: UTF-8 bytes, a user's SentencePiece model, or one trained here on the
training captions. Every tokenizer reserves id 0 for padding (the text tower masks it out) and ends
each caption with an end-of-text id, where the tower pools (`text.pool=last`). Ids of the `bytes`
and `train` kinds: pad 0, end 1, unknown 2, then the vocabulary."""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterable

import numpy as np

from runner.config.schema import TokenizerConfig
from runner.data.sources import DataError

PAD, EOS, UNK = 0, 1, 2
NUM_SPECIAL = 3
MODEL_FILE = "tokenizer.model"  # kind=train writes its model here, in the workdir


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """Text -> ids; `path` is the SentencePiece model file it was loaded from (None for bytes)."""
  vocab_size: int
  ids: Callable[[str], list[int]]  # the caption's ids, without the end id
  eos: int = EOS
  path: str | None = None

  def encode(self, text: str, max_length: int) -> np.ndarray:
    """(max_length,) int32: the ids, cut to keep the end id last, then the end id, then padding."""
    ids = list(self.ids(text))[:max(max_length - 1, 0)] + [self.eos]
    tokens = np.full(max_length, PAD, np.int32)
    tokens[:len(ids)] = ids[:max_length]
    return tokens


def make_tokenizer(config: TokenizerConfig, *, texts: Iterable[str] | None = None,
                   workdir: str | None = None) -> Tokenizer:
  """The tokenizer `config` (text.tokenizer.*) describes; kind=train needs the training `texts`
  and trains once per `workdir` (a model already there is reused: a resumed run keeps its ids)."""
  kind = config.kind
  if kind == "bytes":
    return Tokenizer(vocab_size=256 + NUM_SPECIAL,
                     ids=lambda text: [b + NUM_SPECIAL for b in text.encode("utf-8")])
  if kind == "sentencepiece":
    if not config.path:
      raise DataError("text.tokenizer.kind=sentencepiece needs text.tokenizer.path=<file>, a "
                      "SentencePiece model; or use text.tokenizer.kind=bytes (no model) or train "
                      "(a model trained on the training captions).")
    return load_sentencepiece(config.path)
  if kind == "train":
    if workdir is None:
      raise ValueError("text.tokenizer.kind=train needs the workdir to write its model to")
    path = os.path.join(workdir, MODEL_FILE)
    if not os.path.exists(path):
      train_sentencepiece(texts or [], config.vocab_size, path)
    return load_sentencepiece(path)
  raise DataError(f"unknown text.tokenizer.kind={kind!r}; valid: bytes, sentencepiece, train.")


def load_sentencepiece(path: str) -> Tokenizer:
  """A SentencePiece model file as a Tokenizer: ours, T5's or LiT's (pad 0, an end id) keep their
  ids; others' shift by one to free 0 for padding, with an end id after the vocabulary if none."""
  import sentencepiece  # lazily: only the sentencepiece and train tokenizer kinds need it

  resolved = os.path.expanduser(path)
  if not os.path.isfile(resolved):
    raise DataError(f"text.tokenizer.path={path!r} does not exist; it must be a SentencePiece "
                    "model file (e.g. one written by spm_train, <prefix>.model).")
  try:
    model = sentencepiece.SentencePieceProcessor(model_file=resolved)
  except Exception as e:  # RuntimeError or OSError, depending on how the file is broken
    reason = " ".join(str(e).split()) or type(e).__name__
    raise DataError(f"text.tokenizer.path={path!r} is not a SentencePiece model ({reason}); "
                    "give the .model file that spm_train writes.") from None
  size = model.get_piece_size()
  if model.pad_id() == PAD and model.eos_id() > 0:
    return Tokenizer(vocab_size=size, ids=model.encode, eos=model.eos_id(), path=resolved)
  eos = model.eos_id() + 1 if model.eos_id() >= 0 else size + 1
  return Tokenizer(vocab_size=max(size + 1, eos + 1), path=resolved, eos=eos,
                   ids=lambda text: [i + 1 for i in model.encode(text)])


def train_sentencepiece(texts: Iterable[str], vocab_size: int, path: str) -> None:
  """Trains a unigram SentencePiece model of at most `vocab_size` pieces on `texts`, offline, and
  writes it to `path` atomically (a reader never sees half a file)."""
  import sentencepiece  # lazily: only the train tokenizer kind needs it

  texts = [t for t in texts if t.strip()]
  if not texts:
    raise DataError("text.tokenizer.kind=train has no captions to train on: the training split "
                    "holds no text. Use text.tokenizer.kind=bytes, or data with captions.")
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  prefix = f"{path}.tmp{os.getpid()}"
  sentencepiece.set_random_generator_seed(0)  # the sample of a large corpus it trains on
  try:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
        pad_id=PAD, eos_id=EOS, unk_id=UNK, bos_id=-1, input_sentence_size=2_000_000,
        shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, minloglevel=2)
  except RuntimeError as e:  # 'INTERNAL: src/trainer_interface.cc(638) [check] Vocabulary...'
    reason = " ".join(str(e).split()).rpartition("] ")[2]
    raise DataError(f"cannot train a SentencePiece tokenizer of text.tokenizer.vocab_size="
                    f"{vocab_size} on {len(texts)} captions: {reason} Raise "
                    "text.tokenizer.vocab_size, or use text.tokenizer.kind=bytes.") from None
  os.replace(f"{prefix}.model", path)
  os.remove(f"{prefix}.vocab")
