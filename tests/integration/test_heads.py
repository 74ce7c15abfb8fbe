"""Heteroscedastic heads (model.head.type=het|het_xl) end to end through the CLI, on tiny runs:
pretrain with a learned temperature, eval (fixed evaluation noise), few-shot, fine-tuning from a
linear head (re-initialised or kept as the mean classifier), a partitioned batch ensemble with a
HET-XL head, `vmoe ensemble` of HET runs, and label noise.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import yaml

from conftest import QUIET, TINY_MODEL

from runner.data import pipeline
from runner.evaluators import fewshot_math

pytestmark = pytest.mark.xdist_group("heads")

TRAIN = [*TINY_MODEL, *QUIET, "data.batch_size=16"]
SAMPLES = ["model.head.train_mc_samples=8", "model.head.eval_mc_samples=16"]
# Measured, not computed: they differ between two runs of the same command.
TIMINGS = ("images_per_s", "seconds")
D, K, R = 32, 10, 50  # TINY_MODEL's width, the digits' classes, the default number of factors


def _main(*args: str) -> None:
  from runner import cli
  code = cli.main(list(args))
  assert code == 0, args


def _summary(workdir: pathlib.Path) -> dict:
  return json.loads((workdir / "summary.json").read_text())


def _lines(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def _params(workdir: pathlib.Path) -> dict:
  from runner.checkpoints import checkpoint
  from runner.models.transfer import flatten
  params, _, _ = checkpoint.load_params(str(workdir))
  return {k: np.asarray(v) for k, v in flatten(params).items()}


def _check_the_ensemble_is_its_members_mean(workdir: pathlib.Path, name: str) -> None:
  """The summary's ensemble and member metrics, recomputed in NumPy from the saved member
  probabilities: p̄ = mean of the members' p_m, NLL = -log p[y], KL(p_0 ‖ p_1) =
  Σ p_0 log p_0/p_1."""
  summary = _summary(workdir)
  with np.load(workdir / "predictions.npz") as saved:
    members, probs = saved[f"{name}/member_probs"].astype(np.float64), saved[f"{name}/probs"]
    label = saved[f"{name}/labels"].argmax(-1)
  rows = np.arange(len(label))
  assert members.shape == (2, len(label), K) and len(label) == summary[f"{name}/count"]
  np.testing.assert_allclose(probs, members.mean(0), atol=1e-6)
  nll = lambda p: float(np.mean(-np.log(p[rows, label])))  # noqa: E731
  # The saved probabilities are float32 (relative rounding 6e-8), the summary's float64.
  assert summary[f"{name}/nll"] == pytest.approx(nll(members.mean(0)), rel=1e-6)
  for m in range(2):
    assert summary[f"{name}/member_{m}/nll"] == pytest.approx(nll(members[m]), rel=1e-6)
  kl = np.mean(np.sum(members[0] * np.log(members[0] / members[1]), -1))
  assert summary[f"{name}/diversity/kl"] == pytest.approx(kl, rel=1e-4, abs=1e-8)
  assert summary[f"{name}/diversity/kl"] > 0  # two members that predict differently
  # Jensen: the mean probability is never worse in NLL than the members on average (the
  # ensemble's NLL is computed from float32 log-probabilities: 1e-6 for their rounding).
  assert summary[f"{name}/nll"] <= summary[f"{name}/member_mean/nll"] + 1e-6


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> pathlib.Path:
  return tmp_path_factory.mktemp("heads")


@pytest.fixture(scope="module")
def det(root) -> pathlib.Path:
  """A tiny V-MoE with a linear head, pretrained 4 steps on MNIST."""
  _main("pretrain", f"workdir={root / 'det'}", *TRAIN, "train.steps=4", "schedule.warmup_steps=0",
        "optim.lr=0.01")
  return root / "det"


@pytest.fixture(scope="module")
def het_xl(root) -> pathlib.Path:
  """The same with a HET-XL head and a learned τ (logged every 2 steps)."""
  _main("pretrain", f"workdir={root / 'het_xl'}", "model=vmoe_tiny", *TRAIN, *SAMPLES,
        "model.head.type=het_xl", "train.steps=4", "schedule.warmup_steps=0",
        "train.log_every_steps=2", "optim.lr=0.01")
  return root / "het_xl"


@pytest.fixture(scope="module")
def finetuned(det, root) -> dict[str, pathlib.Path]:
  """HET heads (τ = 1.5) fine-tuned from the linear-head run: a new head (reinit_head=true, the
  default), and the linear head kept as the mean classifier (reinit_head=false), at a learning
  rate so small that the checkpoint shows the starting point."""
  out = {}
  for reinit in ("true", "false"):
    out[reinit] = root / f"het_reinit_{reinit}"
    _main("finetune", f"workdir={out[reinit]}", f"init.checkpoint={det}", *TRAIN, *SAMPLES,
          "model.head.type=het", "model.head.temperature=1.5", f"init.reinit_head={reinit}",
          "train.steps=1", "optim.lr=1e-20", "schedule.warmup_steps=0")
  return out


def test_pretrain_logs_the_learned_temperature(het_xl):
  records = [r for r in _lines(het_xl / "metrics.jsonl") if "train/loss" in r]
  assert [r["step"] for r in records] == [2, 4]
  for r in records:
    assert np.isfinite(r["train/loss"])
    assert 0.05 < r["train/temperature"] < 5.0
    assert r["train/temperature"] != pytest.approx(2.525, abs=1e-7)  # it moved off the midpoint
  summary = _summary(het_xl)
  assert summary["train/temperature"] == records[-1]["train/temperature"]
  config = yaml.safe_load((het_xl / "config.yaml").read_text())
  assert config["model"]["head"]["type"] == "het_xl" and config["model"]["head"]["temperature"] is None
  params = _params(het_xl)
  assert params["head/pre_sigmoid_temperature"].shape == (1,)
  assert params["head/scale_layer_homoscedastic/kernel"].shape == (R, D)


def _without_timings(summary: dict) -> dict:
  return {k: v for k, v in summary.items() if not any(t in k for t in TIMINGS)}


def test_eval_is_reproducible_and_counts_the_head(het_xl, det, root, run_cli):
  for name in ("ev_a", "ev_b"):
    code, _, err = run_cli("eval", f"init.checkpoint={het_xl}", f"workdir={root / name}", *QUIET)
    assert code == 0, err
  a, b = _summary(root / "ev_a"), _summary(root / "ev_b")
  assert _without_timings(a) == _without_timings(b)  # the evaluation noise is fixed
  assert 0 <= a["mnist5k/prec@1"] <= 1 and np.isfinite(a["mnist5k/nll"])
  code, _, err = run_cli("eval", f"init.checkpoint={det}", f"workdir={root / 'ev_det'}", *QUIET)
  assert code == 0, err
  base = _summary(root / "ev_det")
  extra = (D * D + D) + (R * D + D) + (D * D + D) + 1  # HET-XL, parameter-efficient, learned τ
  assert a["compute/params_total"] - base["compute/params_total"] == extra
  # The analytic head FLOPs at eval_mc_samples (S = 16) on top of the linear head's.
  s = 16
  head = 2 * D * K + 2 * D * D + 2 * D * D + 2 * s * R * D + 2 * s * D * K
  key = "compute/gflops_per_image_analytic"
  assert (a[key] - base[key]) * 1e9 == pytest.approx(head - 2 * D * K, rel=1e-6)
  assert a["compute/gflops_per_image"] > base["compute/gflops_per_image"]  # XLA sees it too


def test_fewshot_of_a_het_xl_run(het_xl, tmp_path, run_cli, monkeypatch):
  probed = {}  # dataset -> the test features the ridge classifiers are given
  fit = fewshot_math.fewshot_metrics

  def spy(features, *args, **kwargs):
    probed.update({name: f[2] for name, f in features.items()})
    return fit(features, *args, **kwargs)

  monkeypatch.setattr(fewshot_math, "fewshot_metrics", spy)
  code, out, err = run_cli("fewshot", f"init.checkpoint={het_xl}", f"workdir={tmp_path}", *QUIET,
                           "fewshot.shots=[1,5]", "fewshot.seeds=[0]")
  assert code == 0, err
  summary = _summary(tmp_path)
  values = [v for k, v in summary.items() if "uci_digits" in k and "shot" in k
            and isinstance(v, float)]
  assert values and all(0 <= v <= 1 for v in values), summary
  # The probe reads the pre-logits (D wide) under the HET-XL head, neither its K class logits nor
  # its R factors, and they separate the digits: 5 shots do better than twice chance (1/K).
  (test_features,) = probed.values()
  assert test_features.shape == (summary["uci_digits/num_test"], D)
  assert np.all(np.isfinite(test_features)) and np.ptp(test_features, axis=0).min() > 0
  assert summary["uci_digits/5shot/accuracy"] > 2 / K


def test_finetune_het_from_a_linear_head(finetuned, det):
  old = _params(det)
  assert np.abs(old["head/kernel"]).max() > 1e-4  # the linear head learned something
  kept, fresh = _params(finetuned["false"]), _params(finetuned["true"])
  for p in (kept, fresh):
    assert "head/kernel" not in p and "pre_sigmoid_temperature" not in " ".join(p)
    assert p["head/scale_layer_heteroscedastic/kernel"].shape == (D, K)
    assert np.abs(p["head/diag_layer/kernel"]).max() > 0  # noise layers: fresh lecun normal
  np.testing.assert_allclose(kept["head/loc_layer/kernel"], old["head/kernel"], atol=1e-7)
  np.testing.assert_allclose(kept["head/loc_layer/bias"], old["head/bias"], atol=1e-7)
  assert np.abs(fresh["head/loc_layer/kernel"]).max() < 1e-7  # a new, zero-initialised head
  for name in old:  # the body comes from the checkpoint either way
    if not name.startswith("head/"):
      np.testing.assert_allclose(kept[name], old[name], atol=1e-6, err_msg=name)
  for workdir in finetuned.values():
    summary = _summary(workdir)
    assert summary["train/temperature"] == 1.5 and np.isfinite(summary["train/loss"])


def test_a_partitioned_batch_ensemble_with_a_het_xl_head(det, root, run_cli):
  pbe = root / "pbe_het_xl"
  code, _, err = run_cli("finetune", f"workdir={pbe}", f"init.checkpoint={det}", "model=vmoe_tiny_m2",
                         *TRAIN, *SAMPLES, "model.head.type=het_xl", "train.steps=2",
                         "schedule.warmup_steps=0")
  assert code == 0, err
  assert "train/temperature" in _summary(pbe)
  code, _, err = run_cli("eval", f"init.checkpoint={pbe}", f"workdir={root / 'pbe_ev'}", *QUIET,
                         "eval.save_predictions=true")
  assert code == 0, err
  s = _summary(root / "pbe_ev")
  assert s["ensemble/type"] == "pbe"
  for key in ("prec@1", "nll", "member_0/nll", "member_1/nll", "member_mean/nll",
              "diversity/kl", "diversity/disagreement"):
    assert f"uci_digits/{key}" in s, key
    assert np.isfinite(s[f"uci_digits/{key}"])
  _check_the_ensemble_is_its_members_mean(root / "pbe_ev", "uci_digits")


def test_an_ensemble_of_het_runs(finetuned, root, run_cli):
  members = ",".join(str(p) for p in finetuned.values())
  workdir = root / "ens"
  code, _, err = run_cli("ensemble", f"init.checkpoint=[{members}]", f"workdir={workdir}", *QUIET,
                         "eval.save_predictions=true")
  assert code == 0, err
  s = _summary(workdir)
  assert s["ensemble/size"] == 2 and s["ensemble/type"] == "down-DE"
  for key in ("prec@1", "nll", "member_0/nll", "member_1/nll", "diversity/kl"):
    assert np.isfinite(s[f"uci_digits/{key}"]), key
  _check_the_ensemble_is_its_members_mean(workdir, "uci_digits")


def _labels(examples, key: str) -> np.ndarray:
  return np.concatenate([b[key] for b in examples.batch(1024).as_numpy_iterator()])


def test_training_with_label_noise(tmp_path, run_cli, monkeypatch):
  asked = []  # (source, fraction) of every noisy-label map the run's training stream built
  make_noise = pipeline.noisy_labels

  def spy(source, fraction):
    asked.append((source, fraction))
    return make_noise(source, fraction)

  monkeypatch.setattr(pipeline, "noisy_labels", spy)
  code, _, err = run_cli("pretrain", f"workdir={tmp_path}", *TRAIN, "data.label_noise=0.3",
                         "train.steps=2", "schedule.warmup_steps=0")
  assert code == 0, err
  assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["label_noise"] == 0.3
  assert np.isfinite(_summary(tmp_path)["train/loss"])
  ((source, fraction),) = asked  # one shard, one stream
  assert source.name == "mnist5k" and fraction == 0.3
  # What that stream read: the training split's labels, each of a chosen 30 % of the examples
  # replaced by a uniform class (its own with chance 1/K), so 0.3 (1 - 1/K) = 27 % change.
  key = source.label_key
  clean = _labels(source.read("train"), key)
  noisy = _labels(source.read("train", with_index=True).map(make_noise(source, fraction)), key)
  changed = noisy != clean
  expected, n = fraction * (1 - 1 / K), len(clean)
  assert n == 4000 and abs(changed.mean() - expected) < 4 * np.sqrt(expected * (1 - expected) / n)
  assert set(noisy[changed]) == set(range(K))  # a changed label may become any other class
  # The corrupted examples are a property of the dataset variant: the same in a rebuilt stream.
  again = _labels(source.read("train", with_index=True).map(make_noise(source, fraction)), key)
  np.testing.assert_array_equal(again, noisy)
