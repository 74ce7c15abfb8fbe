"""timm and transformers ViTs as init.checkpoint, against those libraries' own forward pass
(docs/released-checkpoints.md). `make test-export` runs it: it needs torch, timm and transformers.

* Every variant vmoe reproduces, built small by timm or transformers (tests/formats/pytorch_vits.py)
  and saved as they save it, read by vmoe (runner/checkpoints/pytorch_formats.py) into its ViT of
  the model.* keys the files state: its probabilities (a backbone's features) within 1e-5 of the
  library's on the same images, in float32 at the model's resolution. The models' predictions
  differ clearly from image to image, and another GELU than the files' misses the tolerance: a
  reading that drops a detail shows.
* `vmoe eval` itself on a timm state_dict (.safetensors), a timm folder (pytorch_model.bin and
  config.json) and a transformers folder, its saved probabilities against the library's on the
  very batches it evaluated; `vmoe fewshot` on a DINOv2 backbone; `vmoe ensemble` of two
  transformers folders.
* The round trip: a timm ViT (registers, layer scale, CLIP's pre-norm, average pooling with
  fc_norm, exact GELU) upcycled by `vmoe finetune` into a V-MoE at a new resolution with
  Drop-Upcycling (its position embeddings resized as documented, its experts the dense MLP but
  for the redrawn half), exported by `vmoe export`, and the exported PyTorch model's probabilities
  within 1e-5 of `vmoe eval`'s.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("torch")

from formats import pytorch_vits  # noqa: E402

try:
  pytorch_vits.libraries()
except ImportError as e:  # `make test-export` installs them (the torch extra)
  pytest.skip(f"timm and transformers are needed: {e}", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from conftest import QUIET  # noqa: E402
from export.test_export_matches_eval import _eval_batches  # noqa: E402
from runner.checkpoints import checkpoint, weights  # noqa: E402
from runner.config import relations  # noqa: E402
from runner.config.schema import ModelConfig  # noqa: E402
from runner.export import parity  # noqa: E402
from runner.models import build_model  # noqa: E402
from runner.models.transfer import flatten  # noqa: E402

pytestmark = pytest.mark.xdist_group("timm_transformers")

TOLERANCE = 1e-5
EVAL = [*QUIET, "data=uci_digits", "eval.batch_size=40", "eval.corruptions=[]",
        "eval.ood_datasets=[]", "eval.capacity_sweep=[]", "eval.plots=false",
        "eval.save_predictions=true"]
HF_VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=2, intermediate_size=64)
DINOV2 = dict(image_size=28, patch_size=7, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=2, mlp_ratio=2)
FOLDER = dict(width=32, heads=2)  # a folder's config.json gives the head count of any width

# name: how the libraries build and save it (a bare timm state_dict has one of timm's standard
# widths, 192: 3 heads). The variants of the issue, each once at least.
CASES = {
    "timm_class_token": lambda d: pytorch_vits.timm_vit(d, "class_token", save="safetensors"),
    "timm_avg_fc_norm": lambda d: pytorch_vits.timm_vit(
        d, "avg_fc_norm", save="pth", global_pool="avg", class_token=False),
    "timm_avg_with_class_token": lambda d: pytorch_vits.timm_vit(
        d, "avg_cls", save="bin", global_pool="avg"),
    "timm_registers": lambda d: pytorch_vits.timm_vit(d, "registers", save="safetensors",
                                                      reg_tokens=4),
    "timm_registers_positions_without_class": lambda d: pytorch_vits.timm_vit(
        d, "registers_no_embed_class", save="safetensors", reg_tokens=2, no_embed_class=True),
    "timm_layer_scale_deit3": lambda d: pytorch_vits.timm_vit(
        d, "deit3", save="safetensors", init_values=0.1, no_embed_class=True),
    # OpenAI CLIP's: the architecture's name says QuickGELU (config.json's model_args do not).
    "timm_clip_pre_norm_quick_gelu": lambda d: pytorch_vits.timm_vit(
        d, "clip", save="folder", architecture="vit_base_patch16_clip_quickgelu_224", **FOLDER),
    "timm_gelu_tanh": lambda d: pytorch_vits.timm_vit(d, "gelu_tanh", save="safetensors",
                                                      activation="gelu_tanh"),
    "timm_map_siglip": lambda d: pytorch_vits.timm_vit(
        d, "siglip", save="folder_safetensors", architecture="vit_base_patch16_siglip_224",
        activation="gelu_tanh", **FOLDER),
    "timm_map_registers": lambda d: pytorch_vits.timm_vit(
        d, "map_registers", save="safetensors", global_pool="map", class_token=False,
        reg_tokens=1),
    "timm_no_qkv_bias": lambda d: pytorch_vits.timm_vit(d, "no_qkv_bias", save="safetensors",
                                                        qkv_bias=False),
    # vit_medium_patch16_gap's kind: no class token, average pooling after the final norm.
    "timm_no_class_token_gap": lambda d: pytorch_vits.timm_vit(
        d, "gap", save="safetensors", class_token=False, global_pool="avg", fc_norm=False,
        init_values=0.1, qkv_bias=False),
    "transformers_vit_classifier": lambda d: pytorch_vits.transformers_vit(
        d, "vit", "ViTForImageClassification", num_labels=10, **HF_VIT),
    "transformers_vit_gelu_new_no_qkv_bias": lambda d: pytorch_vits.transformers_vit(
        d, "vit_gelu_new", "ViTForImageClassification", num_labels=10, hidden_act="gelu_new",
        qkv_bias=False, **HF_VIT),
    "transformers_vit_quick_gelu": lambda d: pytorch_vits.transformers_vit(
        d, "vit_quick_gelu", "ViTForImageClassification", num_labels=10,
        hidden_act="quick_gelu", **HF_VIT),
    "transformers_vit_model_pooler": lambda d: pytorch_vits.transformers_vit(
        d, "vit_model", "ViTModel", **HF_VIT),
    "transformers_dinov2": lambda d: pytorch_vits.transformers_vit(
        d, "dinov2", "Dinov2Model", layerscale_value=0.5, **DINOV2),
    "transformers_dinov2_registers": lambda d: pytorch_vits.transformers_vit(
        d, "dinov2_registers", "Dinov2WithRegistersModel", num_register_tokens=3, **DINOV2),
}
# Another GELU than the files': the control that the tolerance tells a wrong reading.
_OTHER_GELU = {"gelu": "gelu_tanh", "gelu_tanh": "gelu", "quick_gelu": "gelu"}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, pytorch_vits.Built]:
  root = tmp_path_factory.mktemp("libraries")
  return {name: make(root) for name, make in CASES.items()}


def _keys(b: pytorch_vits.Built) -> dict:
  """The model.* keys of the checkpoint's ViT: what its files state, and what a command gives."""
  architecture = weights.open(str(b.path)).architecture
  keys = {**architecture.stated, **b.given}
  keys["layer_scale"] = 0.1 if keys["layer_scale"] else None  # any: the checkpoint's replace it
  return keys


def _ours(b: pytorch_vits.Built, images_nhwc: np.ndarray, **change) -> np.ndarray:
  """vmoe's probabilities (or features) of the checkpoint read by weights.open."""
  opened = weights.open(str(b.path))
  config = ModelConfig(name="test", **{**_keys(b), **change})
  params, _, _ = opened.load()
  model = build_model(config, opened.architecture.num_classes or 0)
  out, _ = model.apply({"params": params}, jnp.asarray(images_nhwc))
  return np.asarray(jax.nn.softmax(out) if b.logits else out, np.float64)


def _softmax(logits: np.ndarray) -> np.ndarray:
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _far_from_trivial(out: np.ndarray, probabilities: bool) -> bool:
  """Predictions far from uniform (features far from constant): what a model that reads its
  weights wrongly would not reproduce to 1e-5 by chance."""
  if probabilities:
    return np.abs(out - 1 / out.shape[-1]).max() > 0.1
  return out.std(0).mean() > 0.05


def _images(size: int, count: int = 8) -> np.ndarray:
  return np.random.default_rng(0).uniform(-1, 1, (count, size, size, 3)).astype(np.float32)


@pytest.mark.parametrize("case", CASES)
def test_vmoe_reads_the_library_model(built, case):
  b = built[case]
  keys = _keys(b)
  # The keys a command gives are the ones the checkpoint relation asks for: none is missing.
  config = ModelConfig(name="test", **keys)
  run = type("Run", (), {"init": type("Init", (), {"checkpoint": str(b.path), "tower": None}),
                         "model": config})()
  assert relations.model_is_the_checkpoints_vit(run, weights.Checkpoints()) is None
  images = _images(keys["image_size"])
  theirs = b.forward(images.transpose(0, 3, 1, 2))
  theirs = _softmax(theirs) if b.logits else theirs
  ours = _ours(b, images)
  diff = np.abs(ours - theirs).max()
  print(f"\n{case}: {'probabilities' if b.logits else 'features'} max |vmoe - library| = "
        f"{diff:.1e}")
  assert diff <= TOLERANCE
  assert _far_from_trivial(theirs, b.logits)  # a test that can fail
  other = _OTHER_GELU[str(keys["activation"])]
  assert np.abs(_ours(b, images, activation=other) - theirs).max() > TOLERANCE


def _run(*args: str) -> None:
  from runner import cli
  assert cli.main(list(args)) == 0, args


def _command_keys(b: pytorch_vits.Built) -> list[str]:
  """The model= and model.* keys a user gives for the checkpoint (its description's, and what
  its files do not say)."""
  architecture = weights.open(str(b.path)).architecture
  return [*architecture.overrides(), *(f"model.{k}={v}" for k, v in b.given.items())]


def _library_on_eval_batches(b: pytorch_vits.Built, eval_dir: pathlib.Path) -> np.ndarray:
  images, real = _eval_batches(eval_dir, "uci_digits")
  return _softmax(b.forward(images.reshape(-1, *images.shape[2:])[real]))


@pytest.mark.parametrize("case", ["timm_registers", "timm_clip_pre_norm_quick_gelu",
                                  "transformers_vit_classifier"])
def test_vmoe_eval_gives_the_librarys_probabilities(built, case, tmp_path):
  """One run of the CLI per kind of file: a timm state_dict, a timm folder, a transformers
  folder. A bare state_dict also needs model.activation, which its files do not say."""
  b = built[case]
  _run("eval", f"init.checkpoint={b.path}", *_command_keys(b), *EVAL, f"workdir={tmp_path}")
  ours = np.load(tmp_path / "predictions.npz")["uci_digits/probs"]
  theirs = _library_on_eval_batches(b, tmp_path)
  diff = np.abs(ours - theirs).max()
  print(f"\nvmoe eval {case}: {len(ours)} images, max |vmoe - library| = {diff:.1e}")
  assert ours.shape == theirs.shape and diff <= TOLERANCE
  assert _far_from_trivial(theirs, True)


def test_fewshot_and_ensemble_read_them(built, tmp_path):
  """vmoe fewshot on a DINOv2 backbone (its features are the class token's), vmoe ensemble of
  two transformers classifiers: the ensemble's probabilities are the mean of the library's."""
  dinov2 = built["transformers_dinov2_registers"]
  _run("fewshot", f"init.checkpoint=[{dinov2.path}]", *_command_keys(dinov2), *QUIET,
       "fewshot.datasets=[uci_digits]", "fewshot.shots=[2]", "fewshot.seeds=[0]",
       f"workdir={tmp_path / 'fewshot'}")
  summary = json.loads((tmp_path / "fewshot" / "summary.json").read_text())
  assert 0.0 <= summary["uci_digits/2shot/accuracy"] <= 1.0
  first = built["transformers_vit_classifier"]
  second = pytorch_vits.transformers_vit(tmp_path, "vit_seed1", "ViTForImageClassification",
                                         seed=1, num_labels=10, **HF_VIT)
  _run("ensemble", f"init.checkpoint=[{first.path},{second.path}]", *_command_keys(first), *EVAL,
       f"workdir={tmp_path / 'ensemble'}")
  summary = json.loads((tmp_path / "ensemble" / "summary.json").read_text())
  assert summary["ensemble/size"] == 2
  ours = np.load(tmp_path / "ensemble" / "predictions.npz")["uci_digits/probs"]
  theirs = (_library_on_eval_batches(first, tmp_path / "ensemble")
            + _library_on_eval_batches(second, tmp_path / "ensemble")) / 2
  assert np.abs(ours - theirs).max() <= TOLERANCE


def _corner_aligned_resize(posemb: np.ndarray, side: int) -> np.ndarray:
  """(1, n*n, D) -> (1, side*side, D): new cell j on each axis is the linear interpolation of the
  old grid at j * (n - 1) / (side - 1), as docs/training.md states (two 1-D passes)."""
  n = int(round(posemb.shape[1] ** 0.5))
  grid = posemb.astype(np.float64).reshape(n, n, -1)
  where = np.arange(side) * (n - 1) / (side - 1)
  low = np.minimum(np.floor(where).astype(int), n - 2)
  frac = (where - low)[:, None, None]
  grid = grid[low] * (1 - frac) + grid[low + 1] * frac
  frac = frac.transpose(1, 0, 2)
  grid = grid[:, low] * (1 - frac) + grid[:, low + 1] * frac
  return grid.reshape(1, side * side, -1)


def test_a_timm_vit_upcycled_finetuned_and_exported(tmp_path):
  """timm ViT -> vmoe finetune (a V-MoE at 48 px, Drop-Upcycling) -> vmoe export: the exported
  PyTorch model's probabilities within 1e-5 of vmoe eval's, on the eval's own batches."""
  b = pytorch_vits.timm_vit(tmp_path, "upcycle", save="safetensors", reg_tokens=2,
                            init_values=0.1, pre_norm=True, class_token=False,
                            global_pool="avg", no_embed_class=True)
  state = {k: v.numpy() for k, v in b.model.state_dict().items()}
  up, folder, eval_dir = tmp_path / "up", tmp_path / "export", tmp_path / "eval"
  # A V-MoE of the ViT's sizes (vmoe_tiny: 8 experts on block 1), barely learning, so that the
  # checkpoint holds what the transfer made to within 3e-6 (tests/integration/
  # test_released_checkpoints.py says why).
  sizes = ["model.patch_size=8", "model.hidden_size=192", "model.num_layers=2",
           "model.mlp_dim=384", "model.num_heads=3", "model.image_size=48"]
  variant = ["model.classifier=gap", "model.fc_norm=true", "model.registers=2",
             "model.layer_scale=0.1", "model.pre_norm=true", "model.layer_norm_eps=1e-5",
             "model.activation=gelu"]
  _run("finetune", f"init.checkpoint={b.path}", "model=vmoe_tiny", *sizes, *variant,
       "init.dense_to_experts=true", "init.drop_upcycling_ratio=0.5", *QUIET, "train.steps=2",
       "schedule.warmup_steps=0", "data.batch_size=16", "optim.lr=1e-6", f"workdir={up}")
  params = flatten(checkpoint.load_params(str(up))[0])
  atol = 3e-6
  np.testing.assert_allclose(params["pos_embedding"],
                             _corner_aligned_resize(state["pos_embed"], 6), rtol=0, atol=atol)
  np.testing.assert_allclose(params["registers"], state["reg_token"], rtol=0, atol=atol)
  np.testing.assert_allclose(params["block_1/ls2"], state["blocks.1.ls2.gamma"], rtol=0, atol=atol)
  dense = state["blocks.1.mlp.fc1.weight"].T  # (D, F)
  experts = params["block_1/moe/experts/fc1_kernel"]  # (E, D, F)
  kept = np.all(np.abs(experts - dense) <= atol, axis=1).sum(-1)  # columns kept per expert
  assert experts.shape == (8, 192, 384) and np.all(kept == 384 - 192), kept

  _run("export", f"init.checkpoint={up}", f"workdir={folder}", *QUIET)
  config = json.loads((folder / "config.json").read_text())
  variant_keys = ("registers", "layer_scale", "pre_norm", "fc_norm", "activation")
  assert {k: config.get(k) for k in variant_keys} == dict(
      registers=2, layer_scale=True, pre_norm=True, fc_norm=True, activation="gelu")
  assert config["moe"]["num_experts"] == 8
  _run("eval", f"init.checkpoint={up}", *EVAL, f"workdir={eval_dir}")
  ours = np.load(eval_dir / "predictions.npz")["uci_digits/probs"]
  images, real = _eval_batches(eval_dir, "uci_digits")
  exported = parity.torch_probabilities(folder, images)  # batch by batch, as the eval ran them
  theirs = exported.reshape(-1, exported.shape[-1])[real]
  diff = np.abs(theirs - ours).max()
  print(f"\nround trip: {len(ours)} images, max |exported PyTorch - vmoe eval| = {diff:.1e}")
  assert diff <= TOLERANCE
