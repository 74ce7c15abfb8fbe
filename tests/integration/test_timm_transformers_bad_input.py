"""timm and transformers checkpoints vmoe cannot run, given to init.checkpoint: exit code 2 before
anything compiles, one paragraph naming the format found and what is missing or unsupported,
nothing a later resume could take for a run. The files are written with safetensors' NumPy API
(tests/formats/state_dicts.py): no PyTorch here.

Another architecture (a timm ResNet, transformers' Swin and ConvNeXt), a variant vmoe does not
reproduce (timm's qk-norm and SwiGLU MLPs, DINOv2's two-part classifier, a ReLU ViT), tensors that
contradict config.json, a truncated file, a state_dict of something else, a PyTorch pickle where
torch is not installed, an export folder, a backbone given to vmoe eval, and model.* keys that
contradict the files (or leave unsaid what they do not state)."""
from __future__ import annotations

import sys

import pytest

from conftest import fails_clearly, nothing_like_a_run
from formats import state_dicts as sd

from runner.checkpoints import weights

pytestmark = pytest.mark.xdist_group("timm_transformers_bad_input")

LOGS = ["logger.wandb.mode=offline", "logger.progress=false"]
EVAL = [*LOGS, "data=uci_digits"]
FINETUNE = [*LOGS, "train.steps=1", "schedule.warmup_steps=0", "data.batch_size=16"]
RESNET = {"conv1.weight": (8, 3, 7, 7), "bn1.weight": (8,), "bn1.bias": (8,),
          "layer1.0.conv1.weight": (8, 8, 3, 3), "fc.weight": (10, 8), "fc.bias": (10,)}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
  root = tmp_path_factory.mktemp("libraries")
  timm = sd.write(root / "vit.safetensors", sd.timm_shapes())
  truncated = root / "truncated.safetensors"
  truncated.write_bytes(timm.read_bytes()[:-1000])
  qk_norm = {**sd.timm_shapes(), "blocks.0.attn.q_norm.weight": (64,),
             "blocks.0.attn.q_norm.bias": (64,)}
  swiglu = {**sd.timm_shapes(), "blocks.0.mlp.fc1.weight": (2 * 384, 192)}
  wrong = {**sd.vit_shapes(), "vit.layernorm.weight": (48,)}
  dinov2 = {"architectures": ["Dinov2ForImageClassification"], "model_type": "dinov2",
            "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32,
            "patch_size": 8}
  backbone_shapes = {k.removeprefix("vit."): v for k, v in sd.vit_shapes().items()
                     if not k.startswith("classifier")}
  made = {
      "timm": timm,
      "truncated": truncated,
      "resnet_state_dict": sd.write(root / "resnet.safetensors", RESNET),
      "timm_resnet_folder": sd.folder(root / "resnet50", {"architecture": "resnet50",
                                                          "num_classes": 10}, RESNET),
      "swin_folder": sd.folder(root / "swin", {"model_type": "swin", "architectures": [
          "SwinForImageClassification"]}, RESNET),
      "convnext_folder": sd.folder(root / "convnext", {"model_type": "convnext", "architectures": [
          "ConvNextForImageClassification"]}, RESNET),
      "qk_norm": sd.write(root / "qk_norm.safetensors", qk_norm),
      "swiglu": sd.write(root / "swiglu.safetensors", swiglu),
      "dinov2_classifier": sd.folder(root / "dinov2_cls", dinov2, sd.vit_shapes()),
      "relu": sd.folder(root / "relu", {**sd.VIT_CONFIG, "hidden_act": "relu"}, sd.vit_shapes()),
      "contradicting": sd.folder(root / "contradicting", sd.VIT_CONFIG, wrong),
      "vit": sd.folder(root / "vit", sd.VIT_CONFIG, sd.vit_shapes()),
      "backbone": sd.folder(root / "backbone", {**sd.VIT_CONFIG, "architectures": ["ViTModel"]},
                            backbone_shapes),
      "export": sd.folder(root / "export", {"model_type": "vmoe", "hidden_size": 32},
                          sd.vit_shapes()),
      "pickle": root / "vit.pth",
  }
  made["pickle"].write_bytes(b"PK\x03\x04 not read without torch")
  return {k: str(v) for k, v in made.items()}


def _keys(path: str) -> list[str]:
  """The model= and model.* keys the checkpoint's description gives."""
  return weights.open(path).architecture.overrides()


CASES = [
    ("eval", "resnet_state_dict", [], ["is a state_dict (.safetensors) that is neither a timm "
                                       "nor a transformers ViT", "conv1.weight"]),
    ("eval", "timm_resnet_folder", [], ["a timm resnet50 folder, which is not a ViT"]),
    ("eval", "swin_folder", [], ["a transformers swin (SwinForImageClassification)",
                                 "not a ViT"]),
    ("finetune", "convnext_folder", [], ["a transformers convnext", "not a ViT"]),
    ("eval", "truncated", [], ["cannot be read as a .safetensors file", "truncated"]),
    ("finetune", "truncated", [], ["truncated"]),
    ("eval", "qk_norm", [], ["a timm ViT (a bare state_dict)", "blocks.0.attn.q_norm",
                             "qk-norm with a bias", "does not reproduce"]),
    ("eval", "swiglu", [], ["gated (SwiGLU"]),
    ("eval", "dinov2_classifier", [], ["Dinov2ForImageClassification",
                                       "class token and the patches' mean"]),
    ("eval", "relu", [], ["hidden_act='relu'"]),
    ("eval", "contradicting", [], ["a transformers ViT (ViTForImageClassification",
                                   "vit.layernorm.weight: shape (48,), expected (32,)"]),
    ("eval", "export", [], ["a folder `vmoe export` wrote"]),
    ("eval", "timm", ["model=vit_tiny"], ["a timm ViT (a bare state_dict)",
                                          "model.hidden_size=192", "model.activation"]),
    ("finetune", "timm", "keys", ["do not say its MLPs' activation", "model.activation=gelu"]),
    ("eval", "vit", ["model=vit_tiny", "model.patch_size=8"],
     ["model.hidden_size=32", "model.activation=gelu", "model.layer_norm_eps=1e-12",
      "where the model has"]),
    ("eval", "backbone", "keys", ["without a classifier head", "vmoe fewshot"]),
]


@pytest.mark.parametrize("sub, name, args, expected", CASES,
                         ids=[f"{sub}-{name}" for sub, name, _, _ in CASES])
def test_refused_before_anything_runs(sub, name, args, expected, files, run_cli, tmp_path):
  workdir = tmp_path / "w"
  extra = FINETUNE if sub == "finetune" else EVAL
  if args == "keys":
    args = _keys(files[name])
  message = fails_clearly(run_cli(sub, f"init.checkpoint={files[name]}", f"workdir={workdir}",
                                  *extra, *args), *expected)
  assert "Traceback" not in message
  nothing_like_a_run(workdir)


def test_a_pytorch_pickle_without_torch_says_so(files, run_cli, tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, as where it is absent
  fails_clearly(run_cli("eval", f"init.checkpoint={files['pickle']}", f"workdir={tmp_path / 'w'}",
                        *EVAL), "only PyTorch can read", "torch is not installed",
                ".safetensors file")
  nothing_like_a_run(tmp_path / "w")


def test_a_checkpoint_without_model_says_what_it_looks_like(files, run_cli, tmp_path):
  """As for the other released formats: the keys to give, read from config.json."""
  message = fails_clearly(run_cli("eval", f"init.checkpoint={files['vit']}",
                                  f"workdir={tmp_path / 'w'}", *LOGS),
                          "stores parameters only", "model= and data=")
  assert ("a transformers ViT (ViTForImageClassification: model=vit_tiny model.patch_size=8 "
          "model.hidden_size=32 model.num_layers=1 model.mlp_dim=64 model.num_heads=2 "
          "model.activation=gelu model.layer_norm_eps=1e-12; a head of 10 classes)") in message


def test_fc_norm_needs_average_pooling(run_cli, tmp_path):
  """timm's fc_norm normalises the patches' mean: with a class token or a MAP head it is
  refused, not silently the encoder's norm."""
  fails_clearly(run_cli("pretrain", "model=vit_tiny", "model.fc_norm=true",
                        f"workdir={tmp_path / 'w'}", *LOGS),
                "model.fc_norm=true", "model.classifier=gap")
  assert not (tmp_path / "w").exists()
