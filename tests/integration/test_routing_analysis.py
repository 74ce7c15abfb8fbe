"""The routing analysis through the CLI: `vmoe eval ... eval.routing_analysis=true` on tiny runs of
each router family and of a partitioned batch ensemble, its summary, arrays and pictures checked
against each other and against the labels of predictions.npz; `eval.routing.layers`; and the
analysis during training (`val/routing/...`). The numbers themselves are recomputed from the
routing records in tests/unit/test_eval_routing_analysis.py."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.stats

from conftest import QUIET, TINY_MODEL

pytestmark = pytest.mark.xdist_group("routing_analysis")

# Two MoE layers (blocks 0 and 1), 16 px images of 4 px patches: 16 patches.
SHORT = [*QUIET, "train.steps=2", "schedule.warmup_steps=0", "data.batch_size=16",
         "eval.every_steps=0",
         "checkpoint.every_steps=0", "model.moe.layers=[0,1]"]
# 90 test images in batches of 16: the last one has 6 padded rows.
EVAL = [*QUIET, "eval.routing_analysis=true", "eval.save_predictions=true",
        'eval.split="test[:90]"', "eval.routing.capacities=[1.0,0.3]", "eval.routing.images=3"]
COUNT, CLASSES, EXPERTS = 90, 10, 8
# name -> (tokens per image, keys beyond the common ones, pictures)
FAMILIES = {
    "vmoe_tiny": (17, {"load_entropy", "dropped_fraction", "experts_per_token"},
                  {"routing_dropped_patches.png"}),
    "ecmoe_tiny": (16, {"load_entropy", "dropped_fraction", "experts_per_token"},
                   {"routing_dropped_patches.png", "routing_experts_per_token.png"}),
    "softmoe_tiny": (16, {"combine_entropy", "dropped_fraction"}, {"routing_soft_slots.png"}),
}
COMMON = {"uncertainty_class", "mutual_information_class", "uncertainty_position",
          "mutual_information_position", "top1", "top2"}
ROUTED = {f"{m}_{a}_routed" for m in ("uncertainty", "mutual_information")
          for a in ("class", "position")}
PICTURES = {"routing_classes.png", "routing_positions.png", "routing_top_weights.png",
            "routing_dropped_patches.png", "routing_experts_per_token.png",
            "routing_soft_slots.png"}


def _summary(workdir) -> dict:
  return json.loads((workdir / "summary.json").read_text())


def _dependence(joint) -> tuple[float, float]:
  """(I, U(E | A)) of a joint from SciPy entropies: I = H(A) + H(E) - H(A, E)."""
  joint = np.asarray(joint, np.float64)
  h_a, h_e = scipy.stats.entropy(joint.sum(1)), scipy.stats.entropy(joint.sum(0))
  mutual = h_a + h_e - scipy.stats.entropy(joint.ravel())
  return mutual, mutual / h_e


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
  """Tiny runs of every router family and a pBE (2 steps); the token-choice one also runs the
  analysis during training, every 2 of its 4 steps."""
  from runner import cli
  root = tmp_path_factory.mktemp("routing_runs")
  runs = {}
  for name in (*FAMILIES, "vmoe_tiny_k1_m2"):
    runs[name] = root / name
    extra = (["train.steps=4", "schedule.warmup_steps=0", "eval.every_steps=2",
             "eval.routing_analysis=true"]
             if name == "vmoe_tiny" else [])
    assert cli.main(["pretrain", f"model={name}", f"workdir={runs[name]}", *TINY_MODEL, *SHORT,
                     *extra]) == 0
  return runs


@pytest.fixture(scope="module")
def evaluated(upstream, tmp_path_factory):
  """name -> (workdir, summary, routing_analysis.npz, predictions.npz) of `vmoe eval` with the
  analysis on."""
  from runner import cli
  root = tmp_path_factory.mktemp("routing_evals")
  out = {}
  for name, run in upstream.items():
    workdir = root / name
    assert cli.main(["eval", f"init.checkpoint={run}", f"workdir={workdir}", *EVAL]) == 0
    out[name] = (workdir, _summary(workdir), dict(np.load(workdir / "routing_analysis.npz")),
                 dict(np.load(workdir / "predictions.npz")))
  return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_moe_layer_is_reported(evaluated, name):
  workdir, s, z, _ = evaluated[name]
  _, extra, pictures = FAMILIES[name]
  wanted = COMMON | extra | (ROUTED if name != "softmoe_tiny" else set())
  for layer in ("layer_0", "layer_1"):
    got = {k.split("/", 2)[2] for k in s if k.startswith(f"routing/{layer}/")}
    assert got == wanted, layer
    assert 0 <= s[f"routing/{layer}/uncertainty_class"] <= 1
    assert 0 <= s[f"routing/{layer}/uncertainty_position"] <= 1
    assert s[f"routing/{layer}/top1"] >= max(s[f"routing/{layer}/top2"], 1 / EXPERTS)
    assert z[f"{layer}/class_weights"].shape == (CLASSES, EXPERTS)
    assert z[f"{layer}/position_weights"].shape == (16, EXPERTS)
    assert z[f"{layer}/top_histogram"].shape == (2, 50)
  for picture in PICTURES:  # the pictures that apply to the router, and only those
    path = workdir / picture
    shown = picture in pictures | {"routing_classes.png", "routing_positions.png",
                                   "routing_top_weights.png"}
    assert path.exists() == shown, picture
    if shown:
      assert path.stat().st_size > 0 and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_summary_arrays_and_labels_agree(evaluated, name):
  """The scalars recomputed from routing_analysis.npz and the labels of predictions.npz: the
  padded rows of the last batch are not counted."""
  _, s, z, p = evaluated[name]
  tokens = FAMILIES[name][0]
  labels = p["mnist5k/labels"]
  assert labels.shape == (COUNT, CLASSES)
  per_class = labels.sum(0) * tokens  # tokens of each class's images
  for layer in ("layer_0", "layer_1"):
    key = lambda k: s[f"routing/{layer}/{k}"]
    mutual, uncertainty = _dependence(z[f"{layer}/class_weights"] * per_class[:, None])
    assert key("mutual_information_class") == pytest.approx(mutual, rel=1e-5, abs=1e-9)
    assert key("uncertainty_class") == pytest.approx(uncertainty, rel=1e-5, abs=1e-9)
    # Each class's mean weights are a distribution over the experts.
    present = labels.sum(0) > 0
    np.testing.assert_allclose(z[f"{layer}/class_weights"][present].sum(1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(z[f"{layer}/position_weights"].sum(1), 1.0, rtol=1e-5)
    mutual, uncertainty = _dependence(z[f"{layer}/position_weights"])
    assert key("uncertainty_position") == pytest.approx(uncertainty, rel=1e-5, abs=1e-9)
    hist = z[f"{layer}/top_histogram"]
    assert hist.sum(1).tolist() == [COUNT * tokens] * 2
    centres = (np.arange(50) + 0.5) * 0.02
    for i in (1, 2):  # the mean lies within half a bin of the histogram's
      assert abs(hist[i - 1] @ centres / hist[i - 1].sum() - key(f"top{i}")) <= 0.01 + 1e-9
    if name == "softmoe_tiny":
      # Each slot mixes the 16 tokens of its image (routing groups of one image).
      np.testing.assert_allclose(z[f"{layer}/slot_position_weights"].sum(1), 1.0, rtol=1e-5)
      assert 0 < key("combine_entropy") <= math.log(z[f"{layer}/slot_position_weights"].shape[0])
      assert key("dropped_fraction") == 0
      continue
    processed = z[f"{layer}/class_processed"]
    assert key("uncertainty_class_routed") == pytest.approx(_dependence(processed)[1], rel=1e-5,
                                                           abs=1e-9)
    hist = z[f"{layer}/experts_per_token_histogram"]
    assert hist.sum() == COUNT * tokens
    assert key("dropped_fraction") == pytest.approx(hist[0] / hist.sum(), rel=1e-9)
    assert key("experts_per_token") == pytest.approx(processed.sum() / (COUNT * tokens), rel=1e-6)
    assert key("load_entropy") == pytest.approx(
        scipy.stats.entropy(z[f"{layer}/load"]) / math.log(EXPERTS), rel=1e-6)


@pytest.mark.parametrize("name", ["vmoe_tiny", "ecmoe_tiny"])
def test_dropped_patch_maps(evaluated, name):
  """The first MoE layer's maps at each capacity: a lower capacity keeps a subset of the
  patches (each expert's buffer takes a prefix of the same order)."""
  _, _, z, _ = evaluated[name]
  kinds = ["vanilla", "bpr"] if name == "vmoe_tiny" else ["vanilla"]
  group = 8 if name == "vmoe_tiny" else 1  # whole routing groups, at least the 3 images drawn
  maps = {k.split("/", 2)[2]: v for k, v in z.items() if "/dropped/" in k}
  assert {k for k in z if "/dropped/" in k} == {f"layer_0/dropped/{c}/{kind}"
                                                  for c in ("1", "0.3") for kind in kinds}
  for kind in kinds:
    high, low = maps[f"1/{kind}"], maps[f"0.3/{kind}"]
    assert high.dtype == bool and high.shape == (max(group, 3), FAMILIES[name][0])
    assert np.all(low >= high) and low.sum() > high.sum()


def test_layers_option_restricts_the_analysis(upstream, run_cli, tmp_path):
  """eval.routing.layers=[1]: layer 1 alone, its dropped-patch maps included; without padding the
  dropped fraction is the layer's own metric from the classification pass."""
  workdir = tmp_path / "ev"
  code, _, err = run_cli("eval", f"init.checkpoint={upstream['vmoe_tiny']}", f"workdir={workdir}",
                         *QUIET, "eval.routing_analysis=true", "eval.routing.layers=[1]",
                         'eval.split="test[:96]"', "eval.routing.capacities=[0.5]")
  assert code == 0, err
  s = _summary(workdir)
  assert {k.split("/")[1] for k in s if k.startswith("routing/")} == {"layer_1"}
  z = np.load(workdir / "routing_analysis.npz")
  assert {k.split("/")[0] for k in z.files} == {"layer_1"}
  assert {k for k in z.files if "/dropped/" in k} == {"layer_1/dropped/0.5/vanilla",
                                                        "layer_1/dropped/0.5/bpr"}
  assert s["routing/layer_1/dropped_fraction"] == pytest.approx(
      s["mnist5k/moe/layer_1/fraction_dropped_tokens"], abs=1e-6)


def test_partitioned_ensemble_reports_every_member(evaluated):
  workdir, s, z, p = evaluated["vmoe_tiny_k1_m2"]
  experts = EXPERTS // 2  # each member's partition
  wanted = COMMON | ROUTED | {"load_entropy", "dropped_fraction", "experts_per_token"}
  keys = {k for k in s if k.startswith("routing/")}
  assert keys == {f"routing/layer_{i}/member_{m}/{name}" for i in (0, 1) for m in (0, 1)
                  for name in wanted}
  labels = p["mnist5k/labels"]
  for i in (0, 1):
    for m in (0, 1):
      prefix = f"layer_{i}/member_{m}"
      assert z[f"{prefix}/class_weights"].shape == (CLASSES, experts)
      mutual, uncertainty = _dependence(z[f"{prefix}/class_weights"] * labels.sum(0)[:, None])
      assert s[f"routing/{prefix}/uncertainty_class"] == pytest.approx(uncertainty, rel=1e-5,
                                                                        abs=1e-9)
      # A member balances its load over its own E / M experts.
      assert s[f"routing/{prefix}/load_entropy"] == pytest.approx(
          scipy.stats.entropy(z[f"{prefix}/load"]) / math.log(experts), rel=1e-6)
      assert s[f"routing/{prefix}/experts_per_token"] <= 1  # k = 1
  assert {k for k in z if "/dropped/" in k} == {f"layer_0/dropped/{c}/{kind}"
                                                  for c in ("1", "0.3")
                                                  for kind in ("vanilla", "bpr")}
  assert (workdir / "routing_classes.png").stat().st_size > 0


def test_analysis_during_training(upstream):
  run = upstream["vmoe_tiny"]
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in records if "val/prec@1" in r]
  assert [r["step"] for r in evals] == [2, 4]
  for r in evals:
    for layer in ("layer_0", "layer_1"):
      assert 0 <= r[f"val/routing/{layer}/uncertainty_class"] <= 1
      assert r[f"val/routing/{layer}/top1"] >= r[f"val/routing/{layer}/top2"]
      assert 0 <= r[f"val/routing/{layer}/dropped_fraction"] <= 1
  summary = _summary(run)
  assert summary["val/routing/layer_1/top1"] == evals[-1]["val/routing/layer_1/top1"]
  # The pictures and arrays of the last evaluation.
  for picture in ("routing_classes.png", "routing_positions.png", "routing_top_weights.png",
                  "routing_dropped_patches.png"):
    assert (run / picture).stat().st_size > 0
  assert "layer_1/class_weights" in np.load(run / "routing_analysis.npz").files
