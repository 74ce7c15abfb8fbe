"""`vmoe eval` with every measurement on a tiny fine-tuned V-MoE, checked against predictions.npz
recomputed independently with scikit-learn and NumPy; bad eval input fails before compute."""
from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, brier_score_loss, log_loss, roc_auc_score

from conftest import QUIET, TINY_MODEL

pytestmark = pytest.mark.xdist_group("eval_suite")


@pytest.fixture(scope="module")
def digits_0to4(tmp_path_factory):
  """A tiny V-MoE trained on UCI digits 0-4: 5-9 are its near OOD, LFW faces its far OOD."""
  from runner import cli
  workdir = tmp_path_factory.mktemp("d04") / "run"
  code = cli.main(["finetune", f"workdir={workdir}", *TINY_MODEL, *QUIET, "train.steps=30",
                   "data.name=uci_digits_0to4", "data.batch_size=32", "optim.lr=0.1"])
  assert code == 0
  return workdir


@pytest.fixture(scope="module")
def suite(digits_0to4, tmp_path_factory):
  from runner import cli
  workdir = tmp_path_factory.mktemp("suite") / "eval"
  code = cli.main(["eval", f"init.checkpoint={digits_0to4}", f"workdir={workdir}", *QUIET,
                   "eval.ood_datasets=[uci_digits_5to9,lfw_faces]", "eval.ece_bins=10",
                   "eval.corruptions=[gaussian_noise,contrast]", "eval.severities=[1,5]",
                   "eval.capacity_sweep=[1.05,0.2]", "eval.save_predictions=true",
                   "eval.adversarial.epsilons=[0,0.02]", "eval.adversarial.steps=3",
                   "eval.adversarial.max_examples=48"])
  assert code == 0
  return workdir, json.loads((workdir / "summary.json").read_text())


def test_summary_has_every_family_of_metrics(suite):
  workdir, s = suite
  ds = "uci_digits_0to4"
  for key in ("prec@1", "error", "nll", "brier", "ece"):
    assert np.isfinite(s[f"{ds}/{key}"])
  for out in ("uci_digits_5to9", "lfw_faces"):
    for score in ("msp", "max_logit", "entropy", "mahalanobis"):
      for metric in ("auroc", "auprc_in", "auprc_out", "fpr95_in_positive",
                     "fpr95_ood_positive"):
        assert 0 <= s[f"{ds}_vs_{out}/{score}/{metric}"] <= 1
  for name in ("gaussian_noise", "contrast"):
    for sev in (1, 5):
      assert 0 <= s[f"{ds}/corruption/{name}/sev_{sev}/error"] <= 1
    assert s[f"{ds}/corruption/{name}/error"] == pytest.approx(np.mean(
        [s[f"{ds}/corruption/{name}/sev_{v}/error"] for v in (1, 5)]))
  # The strongest contrast reduction hurts more than the mildest.
  assert s[f"{ds}/corruption/contrast/sev_5/nll"] > s[f"{ds}/corruption/contrast/sev_1/nll"]
  assert s["compute/gflops_per_image"] > 0
  assert 0 < s["compute/params_active"] < s["compute/params_total"]
  assert s["compute/images_per_s"] > 0
  for name in ("reliability_uci_digits_0to4.png", "capacity_sweep.png", "capacity_sweep.json",
               "metrics.jsonl", "config.yaml"):
    assert (workdir / name).stat().st_size > 0


def test_pgd_attack_summary(suite):
  workdir, s = suite
  ds = "uci_digits_0to4"
  assert s[f"{ds}/pgd/eps_0/error"] == pytest.approx(s[f"{ds}/pgd/clean/error"])
  assert s[f"{ds}/pgd/eps_0/changed_predictions"] == 0
  assert s[f"{ds}/pgd/eps_0/routing_change/layer_1"] == 0
  assert s[f"{ds}/pgd/eps_0.02/loss"] > s[f"{ds}/pgd/clean/loss"]
  assert 0 < s[f"{ds}/pgd/eps_0.02/routing_change/mean"] <= 1
  assert (workdir / f"pgd_{ds}.png").stat().st_size > 0


def test_capacity_sweep_trades_flops(suite):
  workdir, s = suite
  rows = json.loads((workdir / "capacity_sweep.json").read_text())
  assert {(r["capacity_ratio"], r["batch_priority"]) for r in rows} == {
      (c, b) for c in (1.05, 0.2) for b in (False, True)}
  for routing in ("vanilla", "bpr"):
    full, low = (s[f"capacity_sweep/C_{c}/{routing}/gflops_per_image"] for c in ("1.05", "0.2"))
    assert low < full
  # At the trained capacity the sweep reproduces the main evaluation.
  assert s["capacity_sweep/C_1.05/vanilla/prec@1"] == pytest.approx(s["uci_digits_0to4/prec@1"])


def test_every_number_recomputes_from_predictions(suite):
  workdir, s = suite
  ds = "uci_digits_0to4"
  z = np.load(workdir / "predictions.npz")
  labels, probs = z[f"{ds}/labels"], z[f"{ds}/probs"].astype(np.float64)
  probs /= probs.sum(1, keepdims=True)  # stored as float32
  y = labels.argmax(1)
  assert len(y) == s[f"{ds}/count"]
  assert s[f"{ds}/prec@1"] == pytest.approx(np.mean(probs.argmax(1) == y))
  assert s[f"{ds}/nll"] == pytest.approx(log_loss(y, probs, labels=range(5)), rel=1e-4)
  brier = sum(brier_score_loss(labels[:, c], probs[:, c]) for c in range(5))
  assert s[f"{ds}/brier"] == pytest.approx(brier, rel=1e-4)
  np.testing.assert_allclose(z[f"{ds}/score_msp"], probs.max(1), rtol=1e-5)
  for out in ("uci_digits_5to9", "lfw_faces"):
    for score in ("msp", "max_logit", "entropy", "mahalanobis"):
      a, b = z[f"{ds}/score_{score}"], z[f"{out}/score_{score}"]
      truth = np.r_[np.ones(len(a)), np.zeros(len(b))]
      both = np.r_[a, b]
      key = f"{ds}_vs_{out}/{score}"
      assert s[f"{key}/auroc"] == pytest.approx(roc_auc_score(truth, both))
      assert s[f"{key}/auprc_in"] == pytest.approx(average_precision_score(truth, both))
      assert s[f"{key}/auprc_out"] == pytest.approx(average_precision_score(1 - truth, -both))
      threshold = np.sort(a)[::-1][int(np.ceil(0.95 * len(a))) - 1]
      assert s[f"{key}/fpr95_in_positive"] == pytest.approx(np.mean(b >= threshold))
      threshold = np.sort(b)[int(np.ceil(0.95 * len(b))) - 1]  # flags 95% of OOD: score <= it
      assert s[f"{key}/fpr95_ood_positive"] == pytest.approx(np.mean(a <= threshold))


def test_faces_are_farther_than_digits(suite):
  """Mahalanobis on pre-logits separates faces from digits better than digits 5-9 from 0-4."""
  _, s = suite
  far = s["uci_digits_0to4_vs_lfw_faces/mahalanobis/auroc"]
  near = s["uci_digits_0to4_vs_uci_digits_5to9/mahalanobis/auroc"]
  assert far > 0.9 and far > near


@pytest.mark.parametrize("args, expected", [
    (["eval.datasets=[mnist5k]"], "has 10 classes but the checkpoint's head predicts 5"),
    (["eval.ood_datasets=[no_such_dataset]"], "no_such_dataset"),
    (["eval.corruptions=[fog_machine]"], "eval.corruptions=['fog_machine'] has the item"),
    (["eval.corruptions=[contrast]", "eval.severities=[0,6]"], "eval.severities"),
    (['eval.split="test[:0]"'], "is empty"),
    (["eval.adversarial.epsilons=[8]"], "which must be in [0, 1]"),
    (["eval.ece_bins=0"], "eval.ece_bins"),
])
def test_bad_eval_input_fails_before_compute(digits_0to4, tmp_path, run_cli, args, expected):
  code, _, err = run_cli("eval", f"init.checkpoint={digits_0to4}", f"workdir={tmp_path}", *QUIET,
                         *args)
  assert code == 2 and expected in err, err
  assert "Traceback" not in err
  assert not (tmp_path / "summary.json").exists()
  assert not (tmp_path / "metrics.jsonl").exists()
