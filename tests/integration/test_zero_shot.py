"""What consumes a contrastive checkpoint, end to end through the CLI: `vmoe eval` classifies
zero-shot (checked against logits recomputed here from the checkpoint's towers with NumPy) with
every classifier measurement, and measures retrieval (checked against recall@k of embeddings
computed here); `vmoe fewshot` probes its image tower; `vmoe finetune init.tower=image` starts a
classifier from it; and the bad inputs fail before compute with one paragraph."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from PIL import Image

from conftest import QUIET, TINY_MODEL
from conftest import fails_clearly as _fails_clearly
from conftest import nothing_like_a_run as _nothing_like_a_run

pytestmark = pytest.mark.xdist_group("zero_shot")

TEXT = ["text.width=32", "text.depth=1", "text.mlp_dim=64", "text.num_heads=2",
        "objective.embedding_dim=16"]
LOGS = ["logger.wandb.mode=offline", "logger.progress=false"]  # "no W&B run" is then a real check


@pytest.fixture(scope="module")
def contrastive_run(tmp_path_factory):
  """A tiny V-MoE image tower and text tower trained for a few steps on the embedded captions."""
  from runner import cli
  workdir = tmp_path_factory.mktemp("zs") / "run"
  assert cli.main(["pretrain", "objective=contrastive", f"workdir={workdir}", *TINY_MODEL, *TEXT,
                   *QUIET, "train.steps=6", "schedule.warmup_steps=0", "data.batch_size=32",
                   "eval.every_steps=0"]) == 0
  return workdir


@pytest.fixture(scope="module")
def zero_shot_eval(contrastive_run, tmp_path_factory):
  """`vmoe eval` of the run with nothing about zero-shot said, plus OOD, retrieval, predictions."""
  from runner import cli
  workdir = tmp_path_factory.mktemp("zs_eval") / "eval"
  assert cli.main(["eval", f"init.checkpoint={contrastive_run}", f"workdir={workdir}", *QUIET,
                   "eval.ood_datasets=[lfw_faces]", "eval.retrieval=true",
                   "eval.save_predictions=true"]) == 0
  return workdir, json.loads((workdir / "summary.json").read_text())


@pytest.fixture(scope="module")
def recomputed(contrastive_run):
  """From the checkpoint, outside the CLI: the test split's labels, image embeddings, first
  captions' text embeddings, every held-out prompt's text embedding, and the scale t."""
  import jax
  import jax.numpy as jnp
  from runner import data
  from runner.checkpoints import weights
  from runner.config.resolve import from_dict, stored_model_and_data
  from runner.config.schema import ObjectiveConfig, TextConfig
  from runner.data.captions import CLASS_NAMES, HELD_OUT_TEMPLATES
  from runner.data.pipeline import TextSpec
  from runner.data.tokenizers import make_tokenizer
  from runner.models import inputs
  from runner.models.contrastive import build_two_towers
  params, stored, _ = weights.load(str(contrastive_run))
  model, d = stored_model_and_data(stored)
  text = from_dict(TextConfig, stored["text"])
  tok = make_tokenizer(text.tokenizer, workdir=str(contrastive_run))
  towers = build_two_towers(model, text, from_dict(ObjectiveConfig, stored["objective"]),
                            tok.vocab_size)
  source = data.open_source(d.name, text_key=d.text_key)
  batches = data.eval_batches(source, d.test_split, d.pp, d.batch_size, cache=False,
                              text=TextSpec(d.text_key, tok, text.max_length))
  pair = jax.jit(lambda p, b: towers.apply({"params": p}, inputs.images(b), b["tokens"]))
  images, texts, labels = [], [], []
  for batch in batches.as_numpy_iterator():
    zimg, extras = jax.device_get(pair(params, batch))
    mask = batch["_mask"].astype(bool)
    images.append(zimg[mask])
    texts.append(extras["text_embedding"][mask])
    labels.append(batch["labels"][mask].argmax(-1))
  prompts = [t.format(name) for name in CLASS_NAMES for t in HELD_OUT_TEMPLATES]
  tokens = np.stack([tok.encode(p, text.max_length) for p in prompts])
  _, extras = towers.apply({"params": params}, None, jnp.asarray(tokens))
  return dict(images=np.concatenate(images).astype(np.float64),
              texts=np.concatenate(texts).astype(np.float64), labels=np.concatenate(labels),
              prompts=np.asarray(extras["text_embedding"], np.float64).reshape(
                  len(CLASS_NAMES), len(HELD_OUT_TEMPLATES), -1),
              t=float(np.exp(params["log_temperature"])))


def test_zero_shot_eval_is_a_classifier_of_the_prompts(zero_shot_eval, recomputed):
  from runner.data.captions import CLASS_NAMES, HELD_OUT_TEMPLATES
  workdir, s = zero_shot_eval
  ds = "mnist5k_captions"
  assert s["zero_shot/class_names"] == list(CLASS_NAMES)
  assert s["zero_shot/templates"] == list(HELD_OUT_TEMPLATES)
  assert s["zero_shot/temperature"] == pytest.approx(recomputed["t"], rel=1e-6)
  # NumPy: prompt ensembling (mean, renormalise), then t * cosine, then softmax.
  classes = recomputed["prompts"].mean(1)
  classes /= np.linalg.norm(classes, axis=-1, keepdims=True)
  logits = recomputed["t"] * recomputed["images"] @ classes.T
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  saved = np.load(workdir / "predictions.npz")
  np.testing.assert_allclose(saved[f"{ds}/probs"], probs, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(saved[f"{ds}/labels"].argmax(-1), recomputed["labels"])
  labels = recomputed["labels"]
  assert s[f"{ds}/prec@1"] == pytest.approx(np.mean(probs.argmax(-1) == labels), abs=1e-9)
  assert s[f"{ds}/nll"] == pytest.approx(-np.mean(np.log(probs[np.arange(len(labels)),
                                                               labels])), rel=1e-4)
  # Every classifier measurement: calibration, OOD (Mahalanobis on the image tower's
  # pre-logits included), compute.
  for key in ("error", "ece", "brier"):
    assert np.isfinite(s[f"{ds}/{key}"])
  for score in ("msp", "max_logit", "entropy", "mahalanobis"):
    assert 0 <= s[f"{ds}_vs_lfw_faces/{score}/auroc"] <= 1
  assert s["compute/gflops_per_image"] > 0 and 0 < s["compute/params_active"] < s[
      "compute/params_total"]


def test_retrieval_recall_matches_embeddings_computed_here(zero_shot_eval, recomputed):
  from runner.evaluators.contrastive import recall_at_k
  _, s = zero_shot_eval
  ds = "mnist5k_captions"
  assert s[f"{ds}/retrieval_pairs"] == len(recomputed["labels"]) == 500
  want = recall_at_k(recomputed["images"], recomputed["texts"])
  for k in (1, 5, 10):
    for way in ("i2t", "t2i"):
      assert s[f"{ds}/{way}_recall@{k}"] == pytest.approx(want[f"{way}_recall@{k}"], abs=1e-9)


def test_class_names_and_templates_given(contrastive_run, zero_shot_eval, run_cli, tmp_path):
  names = ["nought", "uno", "deux", "drei", "quattro", "cinco", "seis", "sette", "acht", "nio"]
  templates = ["{}", "digit {}"]
  code, _, err = run_cli("eval", f"init.checkpoint={contrastive_run}", f"workdir={tmp_path}",
                         *QUIET, f"eval.zero_shot.class_names=[{','.join(names)}]",
                         f"eval.zero_shot.templates=[{','.join(repr(t) for t in templates)}]")
  assert code == 0, err
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["zero_shot/class_names"] == names and s["zero_shot/templates"] == templates
  assert s["mnist5k_captions/nll"] != zero_shot_eval[1]["mnist5k_captions/nll"]


def test_fewshot_probes_the_image_tower(contrastive_run, run_cli, tmp_path):
  code, _, err = run_cli("fewshot", f"init.checkpoint={contrastive_run}", f"workdir={tmp_path}",
                         *QUIET, "fewshot.datasets=[uci_digits]", "fewshot.shots=[1,5]",
                         "fewshot.seeds=[0]")
  assert code == 0, err
  s = json.loads((tmp_path / "summary.json").read_text())
  assert 0.1 < s["uci_digits/5shot/accuracy"] <= 1  # chance is 0.1


@pytest.fixture(scope="module")
def finetuned(contrastive_run, tmp_path_factory):
  """A classifier from the run's image tower, one step at a learning rate too small to move it."""
  from runner import cli
  workdir = tmp_path_factory.mktemp("zs_ft") / "run"
  assert cli.main(["finetune", f"init.checkpoint={contrastive_run}", "init.tower=image",
                   f"workdir={workdir}", *TINY_MODEL, *QUIET, "train.steps=1",
                   "schedule.warmup_steps=0",
                   "data.batch_size=16", "optim.lr=1e-9", "eval.every_steps=0"]) == 0
  return workdir


def test_finetune_starts_from_the_image_tower(contrastive_run, finetuned):
  from runner.checkpoints import weights
  from runner.models import transfer
  tower = transfer.flatten(weights.load(str(contrastive_run))[0]["image"])
  classifier = transfer.flatten(weights.load(str(finetuned))[0])
  assert set(classifier) - set(tower) == {"head/kernel", "head/bias"}  # a new head
  for name, value in tower.items():
    np.testing.assert_allclose(classifier[name], value, atol=1e-6, err_msg=name)


# --- bad input: exit 2, one paragraph, no traceback, nothing like a run --------------------------

@pytest.fixture(scope="module")
def caption_file(tmp_path_factory) -> pathlib.Path:
  """Image-caption pairs without labels: 6 for training, 6 for testing."""
  root = tmp_path_factory.mktemp("pairs")
  rng = np.random.default_rng(0)
  rows = []
  for i in range(12):
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), np.uint8)).save(root / f"{i}.png")
    rows.append({"image": f"{i}.png", "caption": f"spot {i}",
                 "split": "train" if i < 6 else "test"})
  (root / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  return root


def test_retrieval_alone_on_captions_without_labels(contrastive_run, caption_file, run_cli,
                                                    tmp_path):
  code, _, err = run_cli("eval", f"init.checkpoint={contrastive_run}", f"workdir={tmp_path}",
                         *QUIET, "data.name=captions", f"data.root={caption_file}",
                         "eval.retrieval=true")
  assert code == 0, err
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["captions/retrieval_pairs"] == 6
  assert 0 <= s["captions/i2t_recall@1"] <= s["captions/i2t_recall@10"] == 1.0  # 6 candidates
  assert not any(k.endswith("prec@1") for k in s)


@pytest.mark.parametrize("args, expected, before_hydra", [
    # zero-shot without class names: captions without labels
    (["data.name=captions", "data.root={captions}"],
     ["eval dataset 'captions' has image-caption pairs but no labels", "eval.retrieval=true"],
     False),
    (["eval.zero_shot.class_names=[a,b]"],
     ["eval.zero_shot.class_names names 2 classes", "'mnist5k_captions' has 10 (zero, one"],
     False),
    (["eval.zero_shot.templates=['a photo of']"],
     ["eval.zero_shot.templates=['a photo of']", "a prompt with one {} where the class name"],
     True),
    (["eval.retrieval=true", "eval.datasets=[mnist5k]"],
     ["eval.retrieval=true needs image-caption pairs", "'mnist5k' has no captions"], False),
])
def test_bad_zero_shot_input(args, expected, before_hydra, contrastive_run, caption_file,
                             run_cli, tmp_path):
  workdir = tmp_path / "w"
  args = [a.replace("{captions}", str(caption_file)) for a in args]
  _fails_clearly(run_cli("eval", f"init.checkpoint={contrastive_run}", f"workdir={workdir}",
                         *LOGS, *args), *expected)
  if before_hydra:
    assert not workdir.exists()
  _nothing_like_a_run(workdir)


@pytest.mark.parametrize("sub, args, expected", [
    ("finetune", ["init.checkpoint={contrastive}"],
     ["is a contrastive run", "init.tower=image"]),
    ("pretrain", ["init.checkpoint={classifier}", "init.tower=image"],
     ["init.tower=image means nothing for init.checkpoint=", "a classifier"]),
    ("pretrain", ["init.tower=image"], ["init.tower=image", "init.checkpoint, which is not set"]),
    ("eval", ["init.checkpoint={classifier}", "eval.retrieval=true"],
     ["eval.retrieval=true means nothing for init.checkpoint=", "a classifier",
      "need a contrastive checkpoint"]),
    ("ensemble", ["init.checkpoint=[{contrastive},{classifier}]"],
     ["init.checkpoint names a contrastive run", "init.tower=image"]),
])
def test_bad_tower_input(sub, args, expected, contrastive_run, finetuned, run_cli, tmp_path):
  workdir = tmp_path / "w"
  args = [a.replace("{contrastive}", str(contrastive_run)).replace("{classifier}", str(finetuned))
          for a in args]
  extra = [*TINY_MODEL, "train.steps=1", "schedule.warmup_steps=0", "data.batch_size=16"] if sub in ("pretrain",
                                                                          "finetune") else []
  _fails_clearly(run_cli(sub, f"workdir={workdir}", *LOGS, *extra, *args), *expected)
  assert not workdir.exists()  # validated before Hydra created anything
