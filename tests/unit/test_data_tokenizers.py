"""Caption tokenizers (runner/data/tokenizers.py): bytes, a given SentencePiece model, one trained
offline on captions; and the tokens they put in the pipelines' batches."""
from __future__ import annotations

import os

import numpy as np
import pytest
import sentencepiece

from runner import data
from runner.config.schema import TokenizerConfig
from runner.data import DataError, captions, tokenizers
from runner.data.tokenizers import EOS, PAD, make_tokenizer

# A few hundred captions: every class name in every template, plus some free text.
TEXTS = ([t.format(name) for t in captions.TRAIN_TEMPLATES + captions.HELD_OUT_TEMPLATES
          for name in captions.CLASS_NAMES] * 3
         + [f"a {colour} {thing} on the {place}" for colour in ("red", "green", "blue", "black")
            for thing in ("dog", "cat", "car", "boat", "bird") for place in ("grass", "road",
                                                                               "water", "table")])


def train_config(vocab_size=64) -> TokenizerConfig:
  return TokenizerConfig(kind="train", vocab_size=vocab_size)


# --- bytes -------------------------------------------------------------------------------------

def test_bytes_round_trip():
  tok = make_tokenizer(TokenizerConfig(kind="bytes"))
  assert tok.vocab_size == 259 and tok.path is None
  text = "a handwritten sëven, 7"
  encoded = text.encode("utf-8")
  tokens = tok.encode(text, 40)
  assert tokens.dtype == np.int32 and tokens.shape == (40,)
  n = len(encoded)
  np.testing.assert_array_equal(tokens[:n], np.frombuffer(encoded, np.uint8) + 3)
  assert tokens[n] == EOS and not tokens[n + 1:].any()
  assert bytes(int(t) - 3 for t in tokens[:n]).decode("utf-8") == text
  assert tokens.min() >= 0 and tokens.max() < tok.vocab_size


def test_cutting_keeps_the_end_id_last_and_padding_fills():
  tok = make_tokenizer(TokenizerConfig())
  np.testing.assert_array_equal(tok.encode("abcdef", 4), [100, 101, 102, EOS])
  np.testing.assert_array_equal(tok.encode("abc", 4), [100, 101, 102, EOS])
  np.testing.assert_array_equal(tok.encode("ab", 4), [100, 101, EOS, PAD])
  np.testing.assert_array_equal(tok.encode("", 3), [EOS, PAD, PAD])
  np.testing.assert_array_equal(tok.encode("abc", 1), [EOS])


# --- SentencePiece -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("workdir")
  return make_tokenizer(train_config(), texts=TEXTS, workdir=str(workdir)), workdir


def test_trained_sentencepiece(trained):
  tok, workdir = trained
  assert tok.path == str(workdir / "tokenizer.model") and os.path.isfile(tok.path)
  assert sorted(os.listdir(workdir)) == ["tokenizer.model"]  # no temporary files left
  assert 20 < tok.vocab_size <= 64 and tok.eos == EOS
  model = sentencepiece.SentencePieceProcessor(model_file=tok.path)
  assert (model.pad_id(), model.eos_id(), model.unk_id(), model.bos_id()) == (0, 1, 2, -1)
  for text in ["a handwritten seven.", "a blue boat on the water", "this is a zero."]:
    tokens = tok.encode(text, 24)
    n = int(np.argmax(tokens == EOS))
    assert n > 0 and not tokens[n + 1:].any() and tokens[:n].min() >= 3
    assert tokens.max() < tok.vocab_size
    assert model.decode(tokens[:n].tolist()) == text  # a lossless round trip
  cut = tok.encode("a handwritten seven.", 3)
  assert cut[-1] == EOS and cut[:2].min() >= 3


def test_trained_model_is_reused_and_loads_as_a_given_model(trained):
  tok, workdir = trained
  stamp = os.stat(tok.path).st_mtime_ns
  again = make_tokenizer(train_config(), workdir=str(workdir))  # no texts: the file is reused
  given = make_tokenizer(TokenizerConfig(kind="sentencepiece", path=tok.path))
  assert os.stat(tok.path).st_mtime_ns == stamp
  for other in (again, given):
    assert other.vocab_size == tok.vocab_size and other.path == tok.path
    for text in TEXTS[::37]:
      np.testing.assert_array_equal(other.encode(text, 16), tok.encode(text, 16))


def test_a_sentencepiece_model_with_default_ids_is_shifted_past_padding(tmp_path):
  """spm_train's defaults: unknown 0, begin 1, end 2, no padding."""
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(TEXTS), model_prefix=str(tmp_path / "plain"), vocab_size=60,
      minloglevel=2)
  model = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "plain.model"))
  assert (model.unk_id(), model.pad_id(), model.eos_id()) == (0, -1, 2)
  tok = make_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(tmp_path / "plain.model")))
  assert tok.vocab_size == 61 and tok.eos == 3
  ids = model.encode("a handwritten seven.")
  np.testing.assert_array_equal(tok.encode("a handwritten seven.", 20)[:len(ids) + 2],
                                [i + 1 for i in ids] + [3, PAD])
  assert model.unk_id() + 1 in tok.encode("€", 4)  # the unknown id, no longer padding


@pytest.mark.parametrize("content, expected", [
    (None, "does not exist"),
    (b"\x00\x01 not a model " * 40, "is not a SentencePiece model"),
    (b"", "is not a SentencePiece model"),
])
def test_missing_or_corrupt_model_file(tmp_path, content, expected):
  path = tmp_path / "tok.model"
  if content is not None:
    path.write_bytes(content)
  with pytest.raises(DataError) as e:
    make_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(path)))
  msg = str(e.value)
  assert f"text.tokenizer.path={str(path)!r}" in msg and expected in msg and "\n" not in msg


def test_sentencepiece_without_a_path():
  with pytest.raises(DataError, match="needs text.tokenizer.path"):
    make_tokenizer(TokenizerConfig(kind="sentencepiece"))


def test_training_errors(tmp_path):
  with pytest.raises(DataError, match="no captions to train on"):
    make_tokenizer(train_config(), texts=["", " "], workdir=str(tmp_path))
  with pytest.raises(DataError, match=f"vocab_size=8 on {len(TEXTS)} captions"):
    make_tokenizer(train_config(8), texts=TEXTS, workdir=str(tmp_path))
  assert not os.listdir(tmp_path)  # nothing half-written


# --- in the pipelines --------------------------------------------------------------------------

def test_batches_hold_sentencepiece_tokens(trained, tfds_dir):
  tok, _ = trained
  source = data.open_source("uci_digits_captions", data_dir=str(tfds_dir), text_key="caption")
  text = data.TextSpec("caption", tok, 8)
  batches = list(data.eval_batches(source, "validation", "decode(1)", 64,
                                   text=text).as_numpy_iterator())
  tokens = np.concatenate([b["tokens"][b["_mask"]] for b in batches])
  assert tokens.dtype == np.int32 and tokens.shape == (179, 8)
  want = np.stack([tok.encode(c, 8) for c in source.captions("validation")])
  np.testing.assert_array_equal(tokens, want)
  batch = next(data.train_batches(source, "train", "decode(1)", 16, seed=0, text=text))
  assert batch["tokens"].shape == (16, 8)
  assert (batch["tokens"] == EOS).sum(axis=1).tolist() == [1] * 16  # one end id per caption
  assert tokenizers.MODEL_FILE == "tokenizer.model"
