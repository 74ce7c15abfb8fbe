"""Image-text data: the captioned embedded digits (runner/data/captions.py), a user's file of
image-caption pairs (runner/data/caption_file.py), COCO-style several captions per image, and the
pipelines' `tokens`.

`VmoeTestCocoStyle` is an ordinary TFDS builder with coco_captions' caption structure (a
sequence of {text, id} per image, no label), prepared into a temporary data_dir and opened by name,
as a prepared coco_captions would be.
"""
from __future__ import annotations

import collections
import itertools
import json

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from runner import data
from runner.config.schema import DataConfig, TokenizerConfig
from runner.data import caption_file, captions, DataError, tokenizers
from runner.errors import UserError

BYTES = tokenizers.make_tokenizer(TokenizerConfig())
LENGTH = 40
TEXT = data.TextSpec("caption", BYTES, LENGTH)


def decode(tokens: np.ndarray) -> str:
  """The caption of a row of bytes-tokenizer tokens (up to the end id)."""
  ids = tokens.tolist()
  return bytes(i - tokenizers.NUM_SPECIAL for i in ids[:ids.index(tokenizers.EOS)]).decode()


# --- the captioned embedded digits -------------------------------------------------------------

@pytest.fixture(scope="module")
def uci_pair(tfds_dir):
  return (data.open_source("uci_digits", data_dir=str(tfds_dir)),
          data.open_source("uci_digits_captions", data_dir=str(tfds_dir), text_key="caption"))


def read_all(source, split):
  ds = source.builder.as_dataset(split=split, shuffle_files=False).batch(10_000)
  return next(iter(tfds.as_numpy(ds)))


def test_templates_and_class_names():
  assert captions.CLASS_NAMES == ("zero", "one", "two", "three", "four", "five", "six", "seven",
                                  "eight", "nine")
  assert len(captions.TRAIN_TEMPLATES) >= 4 and len(captions.HELD_OUT_TEMPLATES) >= 3
  assert not set(captions.TRAIN_TEMPLATES) & set(captions.HELD_OUT_TEMPLATES)
  for template in captions.TRAIN_TEMPLATES + captions.HELD_OUT_TEMPLATES:
    assert template.count("{}") == 1
  assert captions.caption(7, 123) == captions.caption(7, 123)  # fixed per example


def test_caption_builders_are_registered():
  assert {"mnist5k_captions", "uci_digits_captions"} <= set(data.known_names())
  builder = captions.Mnist5kCaptions(data_dir="unused")  # its info, without preparing it
  assert builder.name == "mnist5k_captions"
  assert builder.info.features["image"].shape == (28, 28, 1)
  assert builder.info.features["label"].names == list(captions.CLASS_NAMES)
  assert isinstance(builder.info.features["caption"], tfds.features.Text)


def test_uci_captions_have_the_base_images_labels_and_splits(uci_pair):
  base, captioned = uci_pair
  assert captioned.splits == base.splits == {"train": 1258, "validation": 179, "test": 360}
  assert captioned.num_classes == 10 and captioned.class_names == list(captions.CLASS_NAMES)
  assert captioned.text_key == "caption" and base.text_key is None
  assert base.class_names == [str(i) for i in range(10)]  # a ClassLabel given only its size
  for split in base.splits:
    want, got = read_all(base, split), read_all(captioned, split)
    np.testing.assert_array_equal(got["image"], want["image"])
    np.testing.assert_array_equal(got["label"], want["label"])


def test_uci_captions_name_the_class_in_a_training_template(uci_pair):
  _, captioned = uci_pair
  used = collections.Counter()
  for split in captioned.splits:
    batch = read_all(captioned, split)
    for label, text in zip(batch["label"], batch["caption"]):
      text = text.decode()
      name = captions.CLASS_NAMES[label]
      matches = [t for t in captions.TRAIN_TEMPLATES if t.format(name) == text]
      assert matches, text
      used[matches[0]] += 1
  assert set(used) == set(captions.TRAIN_TEMPLATES)  # the choice spreads over all templates
  texts = read_all(captioned, "validation")["caption"]
  assert captioned.captions("validation") == [t.decode() for t in texts]


def test_without_text_the_captioned_set_trains_as_its_base(uci_pair):
  base, captioned = uci_pair
  spec = "decode(3)|pad(2)|random_crop(8)|flip_lr"
  a = list(itertools.islice(data.train_batches(base, "validation", spec, 32, seed=1), 7))
  b = list(itertools.islice(data.train_batches(captioned, "validation", spec, 32, seed=1), 7))
  for x, y in zip(a, b):
    assert set(y) == {"image", "labels"}
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["labels"], y["labels"])


def test_batches_hold_the_tokens_of_each_caption(uci_pair):
  _, captioned = uci_pair
  batch = next(data.train_batches(captioned, "validation", "decode(1)", 16, seed=0, text=TEXT))
  assert set(batch) == {"image", "labels", "tokens"}
  assert batch["tokens"].shape == (16, LENGTH) and batch["tokens"].dtype == np.int32
  for tokens, labels in zip(batch["tokens"], batch["labels"]):
    name = captions.CLASS_NAMES[labels.argmax()]
    assert decode(tokens) in {t.format(name) for t in captions.TRAIN_TEMPLATES}
  ds = data.eval_batches(captioned, "validation", "decode(1)", 50, text=TEXT)
  batches = list(ds.as_numpy_iterator())
  tokens = np.concatenate([b["tokens"][b["_mask"]] for b in batches])
  want = [BYTES.encode(t, LENGTH) for t in captioned.captions("validation")]
  np.testing.assert_array_equal(tokens, np.stack(want))
  padding = batches[-1]["tokens"][~batches[-1]["_mask"]]
  assert padding.size and not padding.any()


# --- a user's file of image-caption pairs ------------------------------------------------------

def write_png(path, value: int, size=(5, 4)) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  Image.new("RGB", size, (value, value, value)).save(path)


def write_pairs(folder, n: int, splits=None) -> list[dict]:
  """n rows 'picture i' -> images/i.png, an image whose every pixel is 10 * i."""
  rows = []
  for i in range(n):
    write_png(folder / "images" / f"{i}.png", 10 * i)
    row = {"image": f"images/{i}.png", "caption": f"picture {i}"}
    if splits:
      row["split"] = splits[i % len(splits)]
    rows.append(row)
  return rows


def write_jsonl(path, rows) -> None:
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_csv(path, rows, header=("image", "caption", "split")) -> None:
  import csv
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(header)
    for row in rows:
      writer.writerow([row.get(k, "") for k in header])


def pairs_of(source, split) -> dict[str, int]:
  """caption -> pixel value of its image, for every example of the split."""
  ds = data.eval_batches(source, split, "decode(3)", 8, text=TEXT)
  out = {}
  for batch in ds.as_numpy_iterator():
    for image, tokens, real in zip(batch["image"], batch["tokens"], batch["_mask"]):
      if real:
        assert image.min() == image.max()  # one grey value per image
        out[decode(tokens)] = int(image[0, 0, 0])
  return out


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_caption_file_with_splits(tmp_path, kind):
  rows = write_pairs(tmp_path, 12, splits=["train", "train", "validation", "test"])
  path = tmp_path / f"pairs.{kind}"
  (write_jsonl if kind == "jsonl" else write_csv)(path, rows)
  source = data.open_source("captions", root=str(path))
  assert source.splits == {"train": 6, "validation": 3, "test": 3}
  assert source.num_classes == 0 and source.class_names is None and not source.multilabel
  assert source.text_key == "caption"
  for split in source.splits:
    want = {r["caption"]: 10 * int(r["image"][7:-4]) for r in rows if r["split"] == split}
    assert pairs_of(source, split) == want
    assert sorted(source.captions(split)) == sorted(want)
  batch = next(data.train_batches(source, "train", "decode(3)|resize(6)", 4, seed=0, text=TEXT))
  assert set(batch) == {"image", "tokens"} and batch["image"].shape == (4, 6, 6, 3)
  assert data.image_shape(source, "train", "decode(3)|resize(6)") == (6, 6, 3)


def test_caption_file_in_a_folder_without_split_column_holds_out_a_slice(tmp_path):
  rows = write_pairs(tmp_path, 20)
  write_jsonl(tmp_path / "captions.jsonl", rows)
  config = DataConfig(name="captions", root=str(tmp_path), holdout_fraction=0.25,
                      text_key="caption")
  config, source = data.open_data(config)
  assert source.splits == {"train": 20} and source.text_key == "caption"
  assert (config.split, config.eval_split, config.test_split) == ("train[:15]", "train[15:]", None)
  train, held = pairs_of(source, config.split), pairs_of(source, config.eval_split)
  assert len(train) == 15 and len(held) == 5 and not set(train) & set(held)
  assert {**train, **held} == {r["caption"]: 10 * i for i, r in enumerate(rows)}
  # a fixed shuffle, not the file's tail, is held out
  assert set(held) != {f"picture {i}" for i in range(15, 20)}
  _, again = data.open_data(config)
  assert pairs_of(again, config.eval_split) == held


def test_caption_file_images_may_be_of_any_mode_and_size(tmp_path):
  Image.new("L", (7, 3), 90).save(tmp_path / "grey.png")
  Image.new("RGBA", (3, 9), (20, 20, 20, 255)).save(tmp_path / "alpha.png")
  Image.new("RGB", (4, 4), (50, 50, 50)).save(tmp_path / "photo.jpg", quality=100)
  write_jsonl(tmp_path / "captions.jsonl", [{"image": "grey.png", "caption": "grey"},
                                            {"image": "alpha.png", "caption": "alpha"},
                                            {"image": "photo.jpg", "caption": "photo"}])
  source = data.open_source("captions", root=str(tmp_path))
  batch = next(data.eval_batches(source, "train", "decode(3)|resize(4)", 3,
                                 text=TEXT).as_numpy_iterator())
  assert batch["image"].shape == (3, 4, 4, 3)


def test_every_fault_of_a_caption_file_is_reported_together(tmp_path):
  rows = write_pairs(tmp_path, 3)
  (tmp_path / "images" / "notes.png").write_text("not an image")
  write_png(tmp_path / "images" / "cut.png", 50, size=(40, 40))
  (tmp_path / "images" / "cut.png").write_bytes((tmp_path / "images" / "cut.png").read_bytes()[:60])
  lines = [json.dumps(r) for r in rows] + [
      json.dumps({"image": "images/gone.png", "caption": "missing"}),      # line 4
      json.dumps({"image": "images/notes.png", "caption": "a text file"}),  # 5
      json.dumps({"image": "images/cut.png", "caption": "truncated"}),      # 6
      json.dumps({"image": "images/0.png", "caption": "  "}),               # 7
      json.dumps({"image": "images/1.png"}),                                # 8
      json.dumps({"caption": "no image"}),                                  # 9
      json.dumps({"image": "images/2.png", "caption": "x", "split": "val"}),  # 10
      "{not json",                                                          # 11
      "[1, 2]",                                                             # 12
  ]
  path = tmp_path / "pairs.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(DataError) as e:
    data.open_source("captions", root=str(path))
  msg = str(e.value)
  assert isinstance(e.value, UserError) and "\n" not in msg
  for part in [f"data.root={path} has 9 problems",
               "2 lines that are not JSON objects (line 11, line 12)",
               "1 row without an image (line 9)",
               "2 rows with an empty or missing caption (line 7, line 8)",
               "1 row with an unknown split (line 10: 'val')",
               "1 missing image file (line 4: images/gone.png)",
               "2 unreadable or non-image files (line 5: images/notes.png: cannot identify image "
               "file, line 6: images/cut.png:",
               "data.skip_unreadable=true", "train, validation or test"]:
    assert part in msg, (part, msg)


def test_skip_unreadable_leaves_out_rows_with_missing_or_broken_images(tmp_path, capsys):
  rows = write_pairs(tmp_path, 4)
  (tmp_path / "images" / "bad.png").write_bytes(b"\x89PNG broken")
  rows += [{"image": "images/gone.png", "caption": "gone"},
           {"image": "images/bad.png", "caption": "bad"}]
  write_jsonl(tmp_path / "captions.jsonl", rows)
  source = data.open_source("captions", root=str(tmp_path), skip_unreadable=True)
  assert source.splits == {"train": 4}
  assert "warning: skipped 2 rows whose image is missing or unreadable" in capsys.readouterr().err
  # other faults still stop the run
  write_jsonl(tmp_path / "captions.jsonl", rows + [{"image": "images/0.png", "caption": ""}])
  with pytest.raises(DataError, match="1 row with an empty or missing caption"):
    data.open_source("captions", root=str(tmp_path), skip_unreadable=True)
  # as does nothing left to train on
  write_jsonl(tmp_path / "captions.jsonl", rows[4:])
  with pytest.raises(DataError, match="no training rows left"):
    data.open_source("captions", root=str(tmp_path), skip_unreadable=True)


@pytest.mark.parametrize("files, root, expected", [
    ({}, None, ["data=captions needs data.root=<path>"]),
    ({}, "nowhere.jsonl", ["does not exist", "captions.jsonl or captions.csv"]),
    ({"pairs.txt": b"x"}, "pairs.txt", ["neither a .jsonl nor a .csv file"]),
    ({}, ".", ["must hold one of captions.jsonl or captions.csv", "it holds []"]),
    ({"captions.jsonl": b"", "captions.csv": b""}, ".", ["it holds both"]),
    ({"empty.jsonl": b"\n\n"}, "empty.jsonl", ["has 1 problem: no rows."]),
    ({"empty.csv": b"image,caption\n"}, "empty.csv", ["has 1 problem: no rows."]),
    ({"h.csv": b"path,text\na.png,b\n"}, "h.csv",
     ["a header with columns ['path', 'text'], without image and caption"]),
    ({"bin.csv": b"image,caption\n\xff\xfe,x\n"}, "bin.csv", ["not UTF-8 text"]),
])
def test_caption_file_location_errors(tmp_path, files, root, expected):
  for name, content in files.items():
    (tmp_path / name).write_bytes(content)
  with pytest.raises(DataError) as e:
    data.open_source("captions", root=None if root is None else str(tmp_path / root))
  for part in expected:
    assert part in str(e.value), (part, str(e.value))


def test_caption_file_without_training_rows(tmp_path):
  write_jsonl(tmp_path / "captions.jsonl", write_pairs(tmp_path, 4, splits=["test"]))
  with pytest.raises(DataError, match="no training rows"):
    data.open_source("captions", root=str(tmp_path))


def test_pairs_without_classes_need_the_text(tmp_path):
  write_jsonl(tmp_path / "captions.jsonl", write_pairs(tmp_path, 4))
  source = data.open_source("captions", root=str(tmp_path))
  for make in (lambda: data.train_batches(source, "train", "decode(3)", 2, seed=0),
               lambda: data.eval_batches(source, "train", "decode(3)", 2)):
    with pytest.raises(DataError, match="no class labels.*objective=contrastive"):
      make()


def test_caption_file_reads_slices_like_a_tfds_builder(tmp_path):
  write_jsonl(tmp_path / "captions.jsonl", write_pairs(tmp_path, 6))
  builder = data.open_source("captions", root=str(tmp_path)).builder
  assert isinstance(builder, caption_file.CaptionFile)
  whole = [ex["caption"] for ex in tfds.as_numpy(builder.as_dataset(split="train"))]
  part = [ex["caption"] for ex in tfds.as_numpy(builder.as_dataset(split="train[2:5]"))]
  assert part == whole[2:5]
  example = next(iter(builder.as_dataset(split="train[:1]")))
  assert example["image"].shape == (4, 5, 3)  # decoded unless the reader skips decoding


# --- several captions per image (coco_captions) ------------------------------------------------

NUM_COCO, CAPTIONS_PER = 8, 5


class VmoeTestCocoStyle(tfds.core.GeneratorBasedBuilder):
  """8 grey 4x4 images (pixel value i), each with 5 captions 'image i caption j', as coco_captions
  stores them: a sequence of {text, id}, and no label."""
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Test data."}

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(4, 4, 1)),
            "image/id": np.int64,
            "captions": tfds.features.Sequence({"text": np.str_, "id": np.int64}),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples(), "val": self._generate_examples()}

  def _generate_examples(self):
    for i in range(NUM_COCO):
      yield i, {"image": np.full((4, 4, 1), i, np.uint8), "image/id": i,
                "captions": {"text": [f"image {i} caption {j}" for j in range(CAPTIONS_PER)],
                             "id": list(range(CAPTIONS_PER))}}


@pytest.fixture(scope="module")
def coco_dir(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("coco"))
  VmoeTestCocoStyle(data_dir=data_dir).download_and_prepare()
  return data_dir


@pytest.fixture(scope="module")
def coco(coco_dir):
  return data.open_source("vmoe_test_coco_style", data_dir=coco_dir, text_key="captions/text")


COCO_TEXT = data.TextSpec("captions/text", BYTES, LENGTH)


def coco_stream(source, seed, start=0, n=24):
  """(image index, caption index) of the first n training examples from position `start`."""
  stream = data.train_batches(source, "train", "decode(1)", 4, seed=seed, start=start,
                              text=COCO_TEXT)
  out = []
  for batch in itertools.islice(stream, n // 4):
    for image, tokens in zip(batch["image"], batch["tokens"]):
      words = decode(tokens).split()
      assert int(words[1]) == int(image[0, 0, 0])  # the caption is its own image's
      out.append((int(words[1]), int(words[3])))
  return out


def test_coco_style_source(coco):
  assert coco.num_classes == 0 and coco.class_names is None and coco.text_key == "captions/text"
  assert coco.splits == {"train": NUM_COCO, "val": NUM_COCO}
  got = coco.captions("val")
  assert sorted(got) == sorted(f"image {i} caption {j}" for i in range(NUM_COCO)
                               for j in range(CAPTIONS_PER))


def test_coco_style_training_picks_a_caption_per_visit(coco):
  stream = coco_stream(coco, seed=0, n=40)  # 5 epochs of 8 images
  assert coco_stream(coco, seed=0, n=40) == stream  # deterministic
  assert coco_stream(coco, seed=0, start=12, n=28) == stream[12:]  # resuming is exact
  assert coco_stream(coco, seed=1, n=40) != stream
  per_image = collections.defaultdict(set)
  for image, caption in stream:
    per_image[image].add(caption)
  assert len(per_image) == NUM_COCO
  assert sum(len(seen) for seen in per_image.values()) > 2 * NUM_COCO  # visits differ


def test_coco_style_evaluation_takes_the_first_caption(coco):
  batches = list(data.eval_batches(coco, "val", "decode(1)", 3, text=COCO_TEXT).as_numpy_iterator())
  got = [(int(im[0, 0, 0]), decode(t)) for b in batches
         for im, t, real in zip(b["image"], b["tokens"], b["_mask"]) if real]
  assert sorted(got) == [(i, f"image {i} caption 0") for i in range(NUM_COCO)]
  assert all("labels" not in b for b in batches)


@pytest.mark.parametrize("key, expected", [
    ("captions/id", "names no caption (text) feature"),
    ("caption", "its features are ['captions/id', 'captions/text', 'image', 'image/id']"),
])
def test_text_key_must_name_a_text_feature(coco_dir, key, expected):
  with pytest.raises(DataError) as e:
    data.open_source("vmoe_test_coco_style", data_dir=coco_dir, text_key=key)
  assert expected in str(e.value) and f"data.text_key={key!r}" in str(e.value)


def test_coco_captions_unprepared_says_how_to_prepare_it(tmp_path):
  with pytest.raises(DataError) as e:
    data.open_source("coco_captions", data_dir=str(tmp_path), text_key="captions/text")
  msg = str(e.value)
  assert "'coco_captions' is not prepared" in msg and "tfds build coco_captions" in msg
  assert "mnist5k_captions" in msg and "data=captions" in msg
