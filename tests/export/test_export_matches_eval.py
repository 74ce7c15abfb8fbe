"""`vmoe export` end to end: the exported folder, run in PyTorch in a process that never imports
JAX, gives `vmoe eval`'s probabilities on the same batches (the eval's test split, batched and
padded as the eval batches it, so routing groups hold the same images; and the real images alone,
one batch that the model pads as the eval did) to 1e-4 in float32: a ViT,
a token-choice V-MoE at an inference capacity that drops tokens, with Batch Prioritized Routing,
a partitioned batch ensemble, experts-choice, Soft MoE, a checkpoint written in the
google-research/vmoe format, and a plug-in router family (examples/plugins/switch_router.py, whose
`torch_routing` gives its PyTorch router). `make test-export` runs it (it needs PyTorch)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import yaml

pytest.importorskip("torch")

from conftest import QUIET, TINY_MODEL, plugin_lab, vmoe_in  # noqa: E402
from formats import vmoe_writer  # noqa: E402
from formats.reference_tree import Dims, reference_tree  # noqa: E402
from runner.export import parity  # noqa: E402

TOLERANCE = 1e-4
TRAIN = [*QUIET, "train.steps=30", "schedule.warmup_steps=0", "data.batch_size=16",
         "eval.every_steps=0",
         "checkpoint.every_steps=0", "optim.lr=0.01"]
EVAL = [*QUIET, "eval.batch_size=16", "eval.corruptions=[]", "eval.ood_datasets=[]",
        "eval.capacity_sweep=[]", "eval.plots=false", "eval.save_predictions=true"]
DROPPING = ["model.router.capacity_ratio=0.5"]  # the inference capacity: half the slots needed

# name: (the run's model and keys, the keys export and eval add at inference)
CASES = {
    "vit": (["model=vit_tiny"], []),
    "token_choice_dropping": (["model=vmoe_tiny", "model.moe.layers=[1]"], DROPPING),
    "token_choice_bpr": (["model=vmoe_tiny", "model.moe.layers=[1]"],
                         [*DROPPING, "model.router.batch_priority=true"]),
    "pbe": (["model=vmoe_tiny", "model.moe.layers=[1]", "model.router.k=1",
             "model.moe.ensemble_size=2"], DROPPING),
    "experts_choice": (["model=ecmoe_tiny", "model.moe.layers=[1]"], []),
    "soft": (["model=softmoe_tiny", "model.moe.layers=[1]"], []),
}

def _cli(*args: str) -> None:
  from runner import cli
  assert cli.main(list(args)) == 0, args


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[str, list[str]]]:
  """Each case's checkpoint (a short pretraining, or a released-format checkpoint) and the
  keys its export and eval add."""
  root = tmp_path_factory.mktemp("export_runs")
  out = {}
  trained: dict[tuple, str] = {}
  for name, (model, inference) in CASES.items():
    key = tuple(model)
    if key not in trained:  # the two token-choice cases share their run
      trained[key] = str(root / name)
      _cli("pretrain", f"workdir={trained[key]}", *model, *TINY_MODEL, *TRAIN)
    out[name] = (trained[key], inference)
  dims = Dims(hidden=32, layers=2, mlp=64, heads=2, patch=4, image=16, classes=10)
  released = root / "released_vmoe"
  vmoe_writer.write(str(released), reference_tree("vmoe", moe_layers=(1,), experts=8, dims=dims),
                    num_shards=2)
  out["released"] = (str(released), ["model=vmoe_tiny", "model.moe.layers=[1]", *TINY_MODEL,
                                     "data=uci_digits", *DROPPING])
  return out


def _eval_batches(eval_dir: pathlib.Path, dataset: str) -> tuple[np.ndarray, np.ndarray]:
  """The images of every batch `vmoe eval` fed its model (NCHW) and which rows are real."""
  from runner import data
  from runner.models import inputs
  config = yaml.safe_load((eval_dir / "config.yaml").read_text())
  summary = json.loads((eval_dir / "summary.json").read_text())
  d = config["data"]
  source = data.open_source(d["name"], data_dir=d.get("data_dir"), root=d.get("root"))
  batches = data.eval_batches(source, summary[f"{dataset}/split"], d["pp"],
                              config["eval"]["batch_size"], cache=False)
  images, masks = [], []
  for batch in batches.as_numpy_iterator():
    images.append(np.asarray(inputs.images(batch)).transpose(0, 3, 1, 2))  # as the step makes them
    masks.append(batch["_mask"])
  return np.stack(images).astype(np.float32), np.concatenate(masks).astype(bool)


def _same_probabilities(folder: pathlib.Path, eval_dir: pathlib.Path) -> dict:
  """Asserts the exported model gives the eval's probabilities; returns the eval's summary."""
  summary = json.loads((eval_dir / "summary.json").read_text())
  dataset = next(k.split("/")[0] for k in summary if k.endswith("/prec@1"))
  ours = np.load(eval_dir / "predictions.npz")[f"{dataset}/probs"]
  images, real = _eval_batches(eval_dir, dataset)
  # In a process of its own that never imports JAX, as a user's would (it fails if JAX was).
  probs = parity.torch_probabilities(folder, images)
  assert not (folder / "__pycache__").exists()  # the check leaves the user's folder as written
  theirs = probs.reshape(-1, probs.shape[-1])[real]
  assert theirs.shape == ours.shape
  print(f"\n{folder.parent.name}: {len(ours)} images, prec@1 {summary[f'{dataset}/prec@1']:.3f}, "
        f"max |p_torch - p_vmoe| = {np.abs(theirs - ours).max():.2e}")  # docs/export.md's table
  np.testing.assert_allclose(theirs, ours, atol=TOLERANCE, rtol=0)
  # The real images alone, as a user has them, in one batch: MNIST-5k's 500 test images in groups
  # of 8 leave a last group of 4, which the model completes with zero images as the eval did.
  unpadded = parity.torch_probabilities(folder, images.reshape(-1, *images.shape[2:])[real])
  np.testing.assert_allclose(unpadded, ours, atol=TOLERANCE, rtol=0)
  return summary


@pytest.mark.parametrize("case", [*CASES, "released"])
def test_exported_model_gives_vmoe_evals_probabilities(runs, case, tmp_path):
  checkpoint, keys = runs[case]
  folder, eval_dir = tmp_path / "export", tmp_path / "eval"
  _cli("export", f"init.checkpoint={checkpoint}", f"workdir={folder}", *keys, *QUIET)
  for name in ("model.safetensors", "config.json", "modeling_vmoe.py", "README.md"):
    assert (folder / name).is_file(), name
  exported = json.loads((folder / "summary.json").read_text())
  assert exported["export/checked"] and exported["export/max_abs_diff"] <= TOLERANCE

  _cli("eval", f"init.checkpoint={checkpoint}", f"workdir={eval_dir}", *keys, *EVAL)
  summary = _same_probabilities(folder, eval_dir)
  if DROPPING[0] in keys:  # the inference capacity really dropped tokens
    dropped = [v for k, v in summary.items() if "dropped" in k and isinstance(v, float)]
    assert dropped and max(dropped) > 0, {k: v for k, v in summary.items() if "drop" in k}


def test_a_plugin_router_exports_as_it_routes(tmp_path_factory, tmp_path):
  """The example plug-in's family gives its PyTorch router; its export matches its eval at an
  inference capacity that drops tokens. Each command runs in a process of its own, as the
  plug-in tests do (a plug-in changes the registries of the process that loads it)."""
  lab = plugin_lab(tmp_path_factory, "switch_router.py")
  switch = ["plugins=[switch_router]", "model.router.type=switch"]
  up, folder, eval_dir = lab / "up", tmp_path / "export", tmp_path / "eval"
  for args in (["pretrain", f"workdir={up}", "model=vmoe_tiny", "model.moe.layers=[1]", *switch,
                *TINY_MODEL, *TRAIN],
               ["export", f"init.checkpoint={up}", f"workdir={folder}", *switch, *DROPPING,
                *QUIET],
               ["eval", f"init.checkpoint={up}", f"workdir={eval_dir}", *switch, *DROPPING,
                *EVAL]):
    code, _, err = vmoe_in(lab, *args)
    assert code == 0, err[-3000:]
  assert "class SwitchRouter" in (folder / "modeling_vmoe.py").read_text()
  summary = _same_probabilities(folder, eval_dir)
  assert summary["mnist5k/moe/layer_1/fraction_dropped_tokens"] > 0
