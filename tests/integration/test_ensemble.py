"""Ensembles end to end on tiny runs: a V-MoE fine-tuned into a partitioned batch ensemble (pBE,
E³), `vmoe eval` of it, deep ensembles (down-DE), mixed ensembles and MC-dropout with
`vmoe ensemble`, few-shot of a pBE, and re-partitioning a pBE.

Every number `vmoe ensemble` writes for a dataset is recomputed here with NumPy from the member
probabilities it saves in predictions.npz (the summary keys docs/ensembles.md lists).
"""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import yaml
from sklearn.metrics import roc_auc_score

from conftest import QUIET, TINY_MODEL

pytestmark = pytest.mark.xdist_group("ensemble")

DS = "uci_digits"  # fine-tuning's default dataset: 10 classes, 360 test images
OOD = "lfw_faces"
TRAIN = [*TINY_MODEL, *QUIET, "data.batch_size=16"]
# Few steps at a high rate, so that the members learn something and differ.
FINETUNE = [*TRAIN, "train.steps=12", "optim.lr=0.1", "schedule.warmup_steps=2"]
ENSEMBLE_KEYS = ("prec@1", "error", "nll", "brier", "ece")
MEMBER_KEYS = ("prec@1", "nll", "ece")
DIVERSITY_KEYS = ("kl", "cosine_similarity", "disagreement", "normalized_disagreement")
OOD_SCORES = ("msp", "max_logit", "entropy", "mahalanobis")
# Measured, not computed: they differ between two runs of the same command.
TIMINGS = ("images_per_s", "seconds")


def _main(*args: str) -> None:
  from runner import cli
  code = cli.main(list(args))
  assert code == 0, args


def _summary(workdir: pathlib.Path) -> dict:
  return json.loads((workdir / "summary.json").read_text())


# --- runs shared by the tests -------------------------------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory) -> pathlib.Path:
  return tmp_path_factory.mktemp("ensemble")


@pytest.fixture(scope="module")
def upstream(root) -> pathlib.Path:
  """A tiny V-MoE (8 experts, k=2) pretrained 20 steps on MNIST."""
  _main("pretrain", f"workdir={root / 'up'}", *TRAIN, "train.steps=20", "schedule.warmup_steps=2")
  return root / "up"


@pytest.fixture(scope="module")
def pbe(upstream, root) -> pathlib.Path:
  """The upstream V-MoE fine-tuned into a pBE of 2 members (4 experts each, k=1)."""
  _main("finetune", f"workdir={root / 'pbe'}", f"init.checkpoint={upstream}", *FINETUNE,
        "model.moe.ensemble_size=2", "model.router.k=1")
  return root / "pbe"


@pytest.fixture(scope="module")
def down_de(upstream, root) -> pathlib.Path:
  """Two V-MoEs (k=1) fine-tuned from the same upstream run with seeds 0 and 1: <dir>/0, <dir>/1."""
  _main("finetune", "--multirun", f"workdir={root / 'de'}", f"init.checkpoint={upstream}",
        *FINETUNE, "seed=0,1", "model.router.k=1")
  return root / "de"


@pytest.fixture(scope="module")
def pbe_eval(pbe, root):
  workdir = root / "pbe_eval"
  _main("eval", f"init.checkpoint={pbe}", f"workdir={workdir}", *QUIET,
        f"eval.ood_datasets=[{OOD}]", "eval.save_predictions=true")
  return workdir, _summary(workdir)


@pytest.fixture(scope="module")
def de_ensemble(down_de, root):
  workdir = root / "de_ensemble"
  _main("ensemble", f"init.checkpoint=[{down_de / '0'},{down_de / '1'}]", f"workdir={workdir}",
        *QUIET, f"eval.ood_datasets=[{OOD}]", "eval.save_predictions=true")
  return workdir, _summary(workdir)


@pytest.fixture(scope="module")
def member0_eval(down_de, root):
  """The first down-DE member alone, with `vmoe eval`."""
  workdir = root / "member0_eval"
  _main("eval", f"init.checkpoint={down_de / '0'}", f"workdir={workdir}", *QUIET,
        "eval.save_predictions=true")
  return workdir, _summary(workdir)


# --- recomputing the summary from predictions.npz -------------------------------------------------

def _ece(probs: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
  """Equal-width bins (i/B, (i+1)/B] on the top probability (a confidence of 0 in the first)."""
  confidence, correct = probs.max(1), probs.argmax(1) == y
  which = np.clip(np.ceil(confidence * bins).astype(int) - 1, 0, bins - 1)
  total = 0.0
  for b in range(bins):
    inside = which == b
    if inside.any():
      total += inside.sum() * abs(correct[inside].mean() - confidence[inside].mean())
  return total / len(y)


def _recompute(member_probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
  """Every number of the contract for one dataset, from (M, N, C) member probabilities."""
  p = member_probs.astype(np.float64)
  p /= p.sum(-1, keepdims=True)  # stored as float32
  num_members, n, num_classes = p.shape
  y = labels.argmax(1)
  rows = np.arange(n)
  mean = p.mean(0)
  out = {"prec@1": np.mean(mean.argmax(1) == y)}
  out["error"] = 1 - out["prec@1"]
  out["nll"] = -np.mean(np.log(mean[rows, y]))
  out["brier"] = np.mean(((mean - np.eye(num_classes)[y]) ** 2).sum(1))
  out["ece"] = _ece(mean, y)
  for m in range(num_members):
    out[f"member_{m}/prec@1"] = np.mean(p[m].argmax(1) == y)
    out[f"member_{m}/nll"] = -np.mean(np.log(np.maximum(p[m, rows, y], 1e-12)))
    out[f"member_{m}/ece"] = _ece(p[m], y)
  for key in MEMBER_KEYS:
    out[f"member_mean/{key}"] = np.mean([out[f"member_{m}/{key}"] for m in range(num_members)])
  pairs = [(i, j) for i in range(num_members) for j in range(i + 1, num_members)]
  kl, cos, dis = [], [], []
  for i, j in pairs:
    kl.append(np.mean(np.sum(p[i] * (np.log(p[i]) - np.log(p[j])), axis=1)))
    cos.append(np.mean(np.sum(p[i] * p[j], 1)
                       / (np.linalg.norm(p[i], axis=1) * np.linalg.norm(p[j], axis=1))))
    dis.append(np.mean(p[i].argmax(1) != p[j].argmax(1)))
  out["diversity/kl"] = np.mean(kl)
  out["diversity/cosine_similarity"] = np.mean(cos)
  out["diversity/disagreement"] = np.mean(dis)
  out["diversity/normalized_disagreement"] = np.mean(dis) / (out["error"] + 1e-7)
  return out


def _contract_keys(num_members: int, ds: str = DS) -> list[str]:
  keys = [f"{ds}/{k}" for k in ENSEMBLE_KEYS]
  keys += [f"{ds}/member_{m}/{k}" for m in range(num_members) for k in MEMBER_KEYS]
  keys += [f"{ds}/member_mean/{k}" for k in MEMBER_KEYS]
  keys += [f"{ds}/diversity/{k}" for k in DIVERSITY_KEYS]
  keys += ["compute/gflops_per_image", "ensemble/size"]
  return keys


def _check_recomputes(workdir: pathlib.Path, summary: dict, num_members: int) -> None:
  z = np.load(workdir / "predictions.npz")
  member_probs, labels = z[f"{DS}/member_probs"], z[f"{DS}/labels"]
  assert member_probs.shape == (num_members, summary[f"{DS}/count"], 10)
  assert labels.shape == (summary[f"{DS}/count"], 10)
  # The ensemble's prediction is the members' mean probability (not their mean logits).
  np.testing.assert_allclose(z[f"{DS}/probs"], member_probs.mean(0), atol=1e-6)
  want = _recompute(member_probs, labels)
  for key, value in want.items():
    assert summary[f"{DS}/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-7), key
  # The set of keys is exactly the members': no member_<M>.
  assert f"{DS}/member_{num_members}/nll" not in summary


def _check_ood(workdir: pathlib.Path, summary: dict) -> None:
  """OOD scores are the ensemble prediction's: MSP = max of the mean probability."""
  z = np.load(workdir / "predictions.npz")
  np.testing.assert_allclose(z[f"{DS}/score_msp"], z[f"{DS}/member_probs"].mean(0).max(1),
                             rtol=1e-5)
  for score in OOD_SCORES:
    for metric in ("auroc", "auprc_in", "auprc_out", "fpr95_in_positive", "fpr95_ood_positive"):
      assert 0 <= summary[f"{DS}_vs_{OOD}/{score}/{metric}"] <= 1
  a, b = z[f"{DS}/score_msp"], z[f"{OOD}/score_msp"]
  truth = np.r_[np.ones(len(a)), np.zeros(len(b))]
  assert summary[f"{DS}_vs_{OOD}/msp/auroc"] == pytest.approx(
      roc_auc_score(truth, np.r_[a, b]), rel=1e-6)


# --- 1. fine-tuning a V-MoE into a pBE, and vmoe eval of it ------------------------------------

def test_finetune_makes_a_pbe_of_the_vmoe(pbe, upstream):
  from runner.checkpoints import checkpoint
  config = yaml.safe_load((pbe / "config.yaml").read_text())
  assert config["model"]["moe"]["ensemble_size"] == 2
  assert config["model"]["moe"]["ensemble_variant"] == "pbe"
  assert config["model"]["router"]["k"] == 1
  stored = checkpoint.read_config(str(pbe))  # what later stages read
  assert stored["model"]["moe"]["ensemble_size"] == 2 and stored["stage"] == "finetune"
  assert stored["init"]["checkpoint"] == str(upstream)
  # The V-MoE's (D, E) router kernel and (E, ...) experts load unchanged into the pBE.
  params, _, _ = checkpoint.load_params(str(pbe))
  up, _, _ = checkpoint.load_params(str(upstream))
  for name in ("router", "experts"):
    assert _shapes(params["block_1"]["moe"][name]) == _shapes(up["block_1"]["moe"][name]), name
  records = [json.loads(line) for line in (pbe / "metrics.jsonl").read_text().splitlines()]
  losses = [r["train/loss"] for r in records if "train/loss" in r]
  assert losses and np.all(np.isfinite(losses))


def _shapes(tree) -> dict:
  import jax
  return jax.tree.map(np.shape, tree)


def test_eval_of_a_pbe_writes_every_contract_key(pbe_eval):
  workdir, s = pbe_eval
  for key in _contract_keys(2):
    assert key in s, key
    assert np.isfinite(s[key]), key
  assert s["ensemble/size"] == 2
  for score in OOD_SCORES:
    assert f"{DS}_vs_{OOD}/{score}/auroc" in s
  z = np.load(workdir / "predictions.npz")
  for name in ("member_probs", "probs", "labels", "score_msp"):
    assert f"{DS}/{name}" in z.files, name
  # The pBE's two members are different predictors (disjoint experts), not copies.
  assert s[f"{DS}/diversity/kl"] > 0 and s[f"{DS}/diversity/cosine_similarity"] < 1


def test_eval_of_a_pbe_names_its_type(pbe_eval):
  """The contract's ensemble/type is written by `vmoe eval` of a pBE too, not only by
  `vmoe ensemble`."""
  _, s = pbe_eval
  assert s.get("ensemble/type") == "pbe", sorted(k for k in s if k.startswith("ensemble/"))


def test_eval_of_a_pbe_recomputes_from_predictions(pbe_eval, pbe):
  workdir, s = pbe_eval
  _check_recomputes(workdir, s, 2)
  _check_ood(workdir, s)
  # The fine-tuning run's final test evaluation measured the same ensemble prediction.
  trained = _summary(pbe)
  assert s[f"{DS}/nll"] == pytest.approx(trained["test/nll"], rel=1e-5)
  assert s[f"{DS}/prec@1"] == pytest.approx(trained["test/prec@1"])


# --- 2. a deep ensemble of two fine-tuned V-MoEs (down-DE) -------------------------------------

def test_down_de_members_come_from_a_multirun(down_de):
  for job in ("0", "1"):
    config = yaml.safe_load((down_de / job / "config.yaml").read_text())
    assert config["seed"] == int(job) and config["model"]["router"]["k"] == 1
    assert config["model"]["moe"]["ensemble_size"] == 1


def test_down_de_writes_every_contract_key(de_ensemble, down_de):
  _, s = de_ensemble
  assert s["ensemble/type"] == "down-DE"
  assert s["ensemble/size"] == 2
  assert s["checkpoint"] == [str(down_de / "0"), str(down_de / "1")]
  for key in _contract_keys(2):
    assert key in s and np.isfinite(s[key]), key


def test_down_de_numbers_recompute_from_predictions(de_ensemble):
  workdir, s = de_ensemble
  _check_recomputes(workdir, s, 2)


def test_down_de_ood_detection_uses_the_ensemble_prediction(de_ensemble):
  workdir, s = de_ensemble
  _check_ood(workdir, s)


def test_down_de_members_are_the_checkpoints_own_predictions(de_ensemble, member0_eval):
  """member_0 of the ensemble is the first checkpoint evaluated alone (same batches)."""
  workdir, s = de_ensemble
  alone_dir, alone = member0_eval
  z, z0 = np.load(workdir / "predictions.npz"), np.load(alone_dir / "predictions.npz")
  np.testing.assert_allclose(z[f"{DS}/member_probs"][0], z0[f"{DS}/probs"], atol=1e-5)
  np.testing.assert_array_equal(z[f"{DS}/labels"], z0[f"{DS}/labels"])
  for key in MEMBER_KEYS:
    assert s[f"{DS}/member_0/{key}"] == pytest.approx(alone[f"{DS}/{key}"], rel=1e-4, abs=1e-6)
  # A single V-MoE is not an ensemble: no member or diversity keys.
  assert not any("/member_" in k or "/diversity/" in k for k in alone)


# --- 3. mixed ensembles, MC-dropout, compute ---------------------------------------------------

def test_mixed_ensemble_of_a_pbe_and_a_vmoe(pbe, down_de, pbe_eval, member0_eval, run_cli,
                                            tmp_path):
  code, _, err = run_cli("ensemble", f"init.checkpoint=[{pbe},{down_de / '0'}]",
                         f"workdir={tmp_path}", *QUIET)
  assert code == 0, err
  s = _summary(tmp_path)
  assert s["ensemble/type"] == "mixed" and s["ensemble/size"] == 3
  for key in _contract_keys(3):
    assert key in s and np.isfinite(s[key]), key
  # Members in order: the pBE's two, then the V-MoE.
  _, pbe_alone = pbe_eval
  _, vmoe_alone = member0_eval
  for m in (0, 1):
    assert s[f"{DS}/member_{m}/nll"] == pytest.approx(pbe_alone[f"{DS}/member_{m}/nll"],
                                                      rel=1e-4)
  assert s[f"{DS}/member_2/nll"] == pytest.approx(vmoe_alone[f"{DS}/nll"], rel=1e-4)


def test_mc_dropout_samples_are_fixed(down_de, run_cli, tmp_path):
  runs = []
  for name in ("a", "b"):
    code, _, err = run_cli("ensemble", f"init.checkpoint={down_de / '0'}",
                           "ensemble.mc_dropout=3", f"workdir={tmp_path / name}", *QUIET)
    assert code == 0, err
    runs.append(_summary(tmp_path / name))
  a, b = runs
  assert a["ensemble/type"] == "mc-dropout" and a["ensemble/size"] == 3
  for key in _contract_keys(3):
    assert key in a and np.isfinite(a[key]), key
  assert f"{DS}/member_3/nll" not in a
  numbers = {k for k in a if not k.endswith(TIMINGS)}
  assert numbers == {k for k in b if not k.endswith(TIMINGS)}
  for key in numbers:
    assert a[key] == b[key], key
  # Dropout is really on: the samples differ.
  assert a[f"{DS}/diversity/kl"] > 0


def test_mc_dropout_of_a_pbe_counts_every_member(pbe, run_cli, tmp_path):
  """MC-dropout samples of a pBE checkpoint (it has expert dropout, the fine-tuning default): an
  ensemble of samples x M = 3 x 2 members, each with its metrics (runner/inference/members.py,
  Members.size)."""
  code, _, err = run_cli("ensemble", f"init.checkpoint={pbe}", "ensemble.mc_dropout=3",
                         f"workdir={tmp_path}", *QUIET)
  assert code == 0, err
  s = _summary(tmp_path)
  assert s["ensemble/type"] == "mc-dropout" and s["ensemble/size"] == 3 * 2
  for key in _contract_keys(6):
    assert key in s and np.isfinite(s[key]), key
  members = {k.split("/")[1] for k in s if k.startswith(f"{DS}/member_") and "mean" not in k}
  assert members == {f"member_{m}" for m in range(6)}, sorted(members)


def test_deep_ensemble_costs_the_sum_of_its_members(de_ensemble, member0_eval, pbe_eval):
  _, s = de_ensemble
  _, alone = member0_eval
  _, pbe_s = pbe_eval
  single = alone["compute/gflops_per_image"]
  # The two members have one architecture: the ensemble's matmuls are exactly twice a member's.
  analytic = "compute/gflops_per_image_analytic"
  assert s[analytic] == pytest.approx(2 * alone[analytic], rel=1e-12)
  # XLA also counts what the analytic count leaves out, elementwise work (layer norms, softmaxes,
  # residuals: XLA - analytic, about 9 % of a member here) that it simplifies and fuses per
  # program, and the ensemble adds combine_logits (~200 FLOPs per image): about 0.3 % over twice
  # a member on this model. 1 % allows for that; one block of a member missing or counted twice
  # (its matmuls alone, about 20 % of the ensemble's count) does not pass.
  assert s["compute/gflops_per_image"] == pytest.approx(2 * single, rel=0.01)
  # pBE (k=1, M=2) sits between one V-MoE (k=1) and two (E³, Table 11).
  assert single < pbe_s["compute/gflops_per_image"] < s["compute/gflops_per_image"]


def test_down_de_type_does_not_depend_on_how_the_upstream_is_named(upstream, down_de, run_cli,
                                                                   tmp_path):
  """A member fine-tuned from the upstream run's checkpoint folder (<run>/checkpoints/<step>)
  starts from the same checkpoint as one fine-tuned from <run>: still a down-DE.

  The ensemble's type is read from the members' stored configs, and a fine-tune stores
  init.checkpoint as it was given: such a member is the second down-DE member (seed 1, from
  <run>) with <run>/checkpoints/20 in its stored init.checkpoint, not a run trained anew."""
  step_dir = upstream / "checkpoints" / "20"
  assert step_dir.is_dir()
  member = tmp_path / "member"
  shutil.copytree(down_de / "1", member)
  [stored_at] = member.glob("checkpoints/*/config/metadata")
  stored = json.loads(stored_at.read_text())
  assert (stored["stage"], stored["seed"], stored["init"]["checkpoint"]) == (
      "finetune", 1, str(upstream))
  stored["init"]["checkpoint"] = str(step_dir)
  stored_at.write_text(json.dumps(stored))
  code, _, err = run_cli("ensemble", f"init.checkpoint=[{down_de / '0'},{member}]",
                         f"workdir={tmp_path / 'ens'}", *QUIET)
  assert code == 0, err
  assert _summary(tmp_path / "ens")["ensemble/type"] == "down-DE"


# --- 4. few-shot of a pBE ----------------------------------------------------------------------

def test_fewshot_of_a_pbe_probes_its_joint_features(pbe, run_cli, tmp_path, monkeypatch):
  from runner.evaluators import fewshot as fewshot_eval
  widths = []
  original = fewshot_eval.extract_features

  def recording(*args, **kwargs):
    features, labels = original(*args, **kwargs)
    widths.append((features.shape, labels.shape))
    return features, labels

  monkeypatch.setattr(fewshot_eval, "extract_features", recording)
  code, _, err = run_cli("fewshot", f"init.checkpoint=[{pbe}]", f"workdir={tmp_path}", *QUIET,
                         "fewshot.shots=[1,5]", "fewshot.seeds=[0]",
                         "fewshot.datasets=[uci_digits]")
  assert code == 0, err
  s = _summary(tmp_path)
  for shots in (1, 5):
    assert 0 <= s[f"uci_digits/{shots}shot/accuracy"] <= 1
  # One row per image (not per member copy), the 2 members' 32-wide token features side by side.
  assert widths
  for (rows, width), (labels,) in widths:
    assert width == 2 * 32 and rows == labels


# --- 5. a pBE keeps its number of members unless re-partitioned ---------------------------------

def test_pbe_refuses_another_ensemble_size_unless_repartitioned(pbe, run_cli, tmp_path):
  bad = tmp_path / "m4"
  code, out, err = run_cli("finetune", f"workdir={bad}", f"init.checkpoint={pbe}", *TRAIN,
                           "train.steps=1", "schedule.warmup_steps=0", "model.moe.ensemble_size=4",
                           "model.router.k=1")
  assert code == 2, (code, out, err)
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  assert "init.repartition_experts" in err and "model.moe.ensemble_size=4" in err
  assert not (bad / "checkpoints").exists() and not (bad / "summary.json").exists()

  good = tmp_path / "m4_repartitioned"
  code, _, err = run_cli("finetune", f"workdir={good}", f"init.checkpoint={pbe}", *TRAIN,
                         "train.steps=1", "schedule.warmup_steps=0", "model.moe.ensemble_size=4",
                         "model.router.k=1",
                         "init.repartition_experts=true")
  assert code == 0, err
  config = yaml.safe_load((good / "config.yaml").read_text())
  assert config["model"]["moe"]["ensemble_size"] == 4
