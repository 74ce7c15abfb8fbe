"""A researcher's own evaluator, end to end through the installed `vmoe` command: the example
plug-in examples/plugins/per_class_accuracy.py, copied into a folder used as the working
directory and loaded with `plugins=[per_class_accuracy]`, runs during `vmoe pretrain` and
`vmoe finetune` (on the validation split), in `vmoe eval` (every eval dataset) and in
`vmoe ensemble` (the ensemble's prediction); its numbers are recomputed here with scikit-learn
from predictions.npz, and a bad value of its keys fails before compute like a built-in key's.

The commands run away from this pytest process, as a user's would: registering the plug-in changes
the registry and the eval.* schema of the process that loads it. Those that load the plug-in share
one process (the module's `vmoe` fixture, conftest.VmoeDriver); the command that names no plug-in
starts `vmoe` afresh (vmoe_in), where nothing has registered the evaluator.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from sklearn.metrics import balanced_accuracy_score, confusion_matrix

from conftest import QUIET, TINY_MODEL, plugin_lab, vmoe_driver, vmoe_in
from conftest import fails_clearly as _fails_clearly

pytestmark = pytest.mark.xdist_group("plugin_evaluator")

PLUGIN = ["plugins=[per_class_accuracy]", "eval.per_class_accuracy.enabled=true"]
TRAIN = [*TINY_MODEL, *QUIET, "data.batch_size=32", "train.steps=4", "schedule.warmup_steps=0"]
KEY = "per_class_accuracy"


def _run(vmoe, *args: str) -> dict:
  """A command that must succeed; its summary.json."""
  code, _, err = vmoe(*args)
  assert code == 0, err[-3000:]
  workdir = next(a.split("=", 1)[1] for a in args if a.startswith("workdir="))
  return json.loads((pathlib.Path(workdir) / "summary.json").read_text())


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> pathlib.Path:
  return plugin_lab(tmp_path_factory, "per_class_accuracy.py")


@pytest.fixture(scope="module")
def vmoe(lab):
  """`vmoe <args>` in the lab, in the one process of this module's commands that load the plug-in."""
  with vmoe_driver(lab) as driver:
    yield driver


@pytest.fixture(scope="module")
def pretrained(lab, vmoe):
  """A tiny V-MoE pretrained on MNIST with the plug-in evaluated every 2 steps."""
  workdir = lab / "up"
  summary = _run(vmoe, "pretrain", f"workdir={workdir}", *TRAIN, "eval.every_steps=2", *PLUGIN)
  return workdir, summary


@pytest.fixture(scope="module")
def finetuned(lab, vmoe):
  """A tiny V-MoE fine-tuned on UCI digits from scratch (fine-tuning's expert dropout: MC-dropout
  samples it) with the plug-in evaluated every 2 steps; eval and ensemble read it too."""
  workdir = lab / "down"
  summary = _run(vmoe, "finetune", f"workdir={workdir}", *TRAIN, "eval.every_steps=2", *PLUGIN)
  return workdir, summary


def _check_consistent(summary: dict, prefix: str, k: int = 3) -> list[float]:
  """The per-class numbers of one dataset agree with each other; returns them."""
  per_class = [v for key, v in summary.items() if key.startswith(f"{prefix}/")
               and key.rsplit("/", 1)[1] not in ("balanced", "worst_mean")]
  assert 2 <= len(per_class) <= 10 and all(0 <= v <= 1 for v in per_class)
  assert summary[f"{prefix}/balanced"] == pytest.approx(np.mean(per_class))
  assert summary[f"{prefix}/worst_mean"] == pytest.approx(np.mean(sorted(per_class)[:k]))
  return per_class


def _check_in_training(workdir: pathlib.Path, s: dict, dataset: str) -> None:
  """Measured on the validation split every eval.every_steps (2 of 4 steps) and at the end."""
  per_class = _check_consistent(s, f"val/{dataset}/{KEY}")
  # prec@1 is the per-class accuracies weighted by the classes' sizes: between the extremes.
  assert min(per_class) <= s["val/prec@1"] <= max(per_class)
  logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in logged if f"val/{dataset}/{KEY}/balanced" in r] == [2, 4]


@pytest.mark.slow  # the same evaluation as fine-tuning's (below), in the other training stage
def test_runs_during_pretraining_on_the_validation_split(pretrained):
  workdir, s = pretrained
  _check_in_training(workdir, s, "mnist5k")
  assert (workdir / "per_class_accuracy_mnist5k.png").stat().st_size > 0


def test_runs_during_finetuning(finetuned):
  _check_in_training(*finetuned, "uci_digits")


def _recompute(workdir: pathlib.Path, summary: dict, dataset: str) -> None:
  """The summary's per-class accuracies from the saved labels and probabilities."""
  saved = np.load(workdir / "predictions.npz")
  y, predicted = saved[f"{dataset}/labels"].argmax(1), saved[f"{dataset}/probs"].argmax(1)
  counts = confusion_matrix(y, predicted, labels=range(10))
  present = np.flatnonzero(counts.sum(1))
  expected = counts.diagonal()[present] / counts.sum(1)[present]
  got = [summary[f"{dataset}/{KEY}/{c}"] for c in present]
  np.testing.assert_allclose(got, expected, rtol=1e-12)
  balanced = balanced_accuracy_score(y, predicted)
  assert summary[f"{dataset}/{KEY}/balanced"] == pytest.approx(balanced)
  assert summary[f"{dataset}/{KEY}/worst_mean"] == pytest.approx(np.sort(expected)[:2].mean())
  weighted = np.sum(expected * counts.sum(1)[present]) / len(y)
  assert weighted == pytest.approx(summary[f"{dataset}/prec@1"])
  np.testing.assert_allclose(saved[f"{dataset}/{KEY}"][present], expected)
  assert (workdir / f"per_class_accuracy_{dataset.replace(':', '_')}.png").stat().st_size > 0


def test_eval_measures_every_dataset(lab, vmoe, finetuned):
  workdir = lab / "eval"
  s = _run(vmoe, "eval", f"init.checkpoint={finetuned[0]}", f"workdir={workdir}", *QUIET, *PLUGIN,
           "eval.per_class_accuracy.top_k_worst=2", "eval.save_predictions=true",
           "eval.datasets=[uci_digits,uci_digits:validation]")
  for dataset in ("uci_digits", "uci_digits:validation"):
    _recompute(workdir, s, dataset)


def test_ensemble_measures_the_ensemble_prediction(lab, vmoe, finetuned):
  workdir = lab / "ensemble"
  s = _run(vmoe, "ensemble", f"init.checkpoint=[{finetuned[0]}]", "ensemble.mc_dropout=2",
           f"workdir={workdir}", *QUIET, *PLUGIN, "eval.per_class_accuracy.top_k_worst=2",
           "eval.save_predictions=true")
  assert s["ensemble/size"] == 2
  _recompute(workdir, s, "uci_digits")


@pytest.mark.parametrize("sub, args, expected", [
    ("eval", [*PLUGIN, "eval.per_class_accuracy.top_k_worst=0"],
     ["eval.per_class_accuracy.top_k_worst=0 must be >= 1", "worst_mean"]),
    ("pretrain", [*TRAIN, *PLUGIN, "eval.per_class_accuracy.top_k_worst=0"],
     ["eval.per_class_accuracy.top_k_worst=0 must be >= 1"]),
    # Without plugins= (nor a checkpoint whose run recorded it: vmoe eval of `finetuned` loads
    # the run's plug-ins, test_plugin_router.py) nothing registers the evaluator: no such keys.
    ("pretrain", [*TRAIN, "eval.per_class_accuracy.enabled=true"], ["eval.per_class_accuracy"]),
])
def test_bad_plugin_input_fails_before_compute(sub, args, expected, lab, vmoe, finetuned,
                                               tmp_path):
  workdir = tmp_path / "w"
  checkpoint = [f"init.checkpoint={finetuned[0]}"] if sub == "eval" else []
  command = (sub, f"workdir={workdir}", *checkpoint, *args)
  # Naming no plug-in, the command must not find the evaluator registered: a fresh process.
  names_one = any(a.startswith("plugins=") for a in args)
  _fails_clearly(vmoe(*command) if names_one else vmoe_in(lab, *command), *expected)
  assert not workdir.exists()


# A plug-in evaluator whose module states a rule between its keys and another section, with the
# relation decorator the built-in evaluators use (runner/evaluators/corruption.py).
RULED_PLUGIN = '''
import dataclasses

from runner.config.schema import EvalSuiteConfig
from runner.evaluators import Evaluator, Result, register, relation


@dataclasses.dataclass
class DrawnConfig:
  enabled: bool = False


@relation
def drawn_needs_plots(eval: EvalSuiteConfig):
  if eval.drawn.enabled and not eval.plots:
    return ("eval.drawn.enabled=true with eval.plots=false: what it measures is a plot; drop "
            "eval.plots=false.")


@register
class Drawn(Evaluator):
  name = "drawn"
  enabling_key = "eval.drawn.enabled"
  Config = DrawnConfig

  def run(self):
    return Result()
'''


def test_a_plugin_relation_refuses_before_compute(lab, finetuned, tmp_path):
  (lab / "drawn.py").write_text(RULED_PLUGIN)
  workdir = tmp_path / "w"
  _fails_clearly(vmoe_in(lab, "eval", f"workdir={workdir}", f"init.checkpoint={finetuned[0]}",
                         *QUIET, "plugins=[per_class_accuracy,drawn]", "eval.drawn.enabled=true",
                         "eval.plots=false"),
                 "eval.drawn.enabled=true with eval.plots=false: what it measures is a plot")
  assert not workdir.exists()
