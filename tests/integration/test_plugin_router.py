"""A researcher's own router family, end to end through the CLI: the example plug-in
examples/plugins/switch_router.py (Switch top-1 routing with ST-MoE's router z-loss), copied into
a folder used as the working directory and loaded with `plugins=[switch_router]`, pretrains (its
keys recorded, its metrics logged and recomputed here with NumPy), evaluates (GFLOPs, PGD's
routing change, the capacity sweep, the routing analysis), fine-tunes from its own checkpoint
(the router's weights carried over), runs as a two-job sweep, and fails clearly on bad input.

The commands run away from this pytest process, as a user's would: registering the family adds
its keys to the model.router.* schema of the process that loads it, which must not leak into the
other tests of this pytest process. Those that load the plug-in share one process (the module's
`vmoe` fixture, conftest.VmoeDriver); a command that must not find it loaded (one that names no
plug-in, or runs where it cannot be imported) starts `vmoe` afresh (vmoe_in).
"""
from __future__ import annotations

import fractions
import json
import math
import pathlib

import numpy as np
import pytest
import yaml

from architecture_flops import dense_twin_flops
from conftest import (QUIET, TINY_MODEL, fails_clearly, nothing_like_a_run, plugin_lab,
                      vmoe_driver, vmoe_in)

pytestmark = pytest.mark.xdist_group("plugin_router")

SWITCH = ["plugins=[switch_router]", "model=vmoe_tiny", "model.router.type=switch"]
SHORT = [*TINY_MODEL, *QUIET, "train.steps=3", "schedule.warmup_steps=0", "data.batch_size=16",
         "eval.every_steps=0",
         "checkpoint.every_steps=0", "model.moe.layers=[1]"]
Z_LOSS_WEIGHT = 0.2  # not the family's default (0): the recorded value is the one given
EXPERTS = 8  # vmoe_tiny's
# The keys of the routing analysis for a discrete router whose family adds no view
# (tests/integration/test_routing_analysis.py checks the numbers for the built-in families).
ANALYSIS = {"uncertainty_class", "mutual_information_class", "uncertainty_position",
            "mutual_information_position", "top1", "top2", "load_entropy", "dropped_fraction",
            "experts_per_token", *(f"{m}_{a}_routed" for m in ("uncertainty", "mutual_information")
                                   for a in ("class", "position"))}


def _run(vmoe, *args: str) -> pathlib.Path:
  """A command that must succeed; its workdir."""
  code, _, err = vmoe(*args)
  assert code == 0, err[-3000:]
  return pathlib.Path(next(a.split("=", 1)[1] for a in args if a.startswith("workdir=")))


def _summary(workdir: pathlib.Path) -> dict:
  return json.loads((workdir / "summary.json").read_text())


def _config(workdir: pathlib.Path) -> dict:
  return yaml.safe_load((workdir / "config.yaml").read_text())


def _train_records(workdir: pathlib.Path) -> list[dict]:
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [r for r in records if "train/loss" in r]


def _params(workdir: pathlib.Path) -> dict:
  from runner.checkpoints import weights
  return weights.load(str(workdir))[0]


def _switch_capacity(tokens: int, experts: int, ratio: float) -> int:
  """Switch's slots per expert for a group of `tokens`: round(S * C / E), half up, at least 1."""
  return max(1, math.floor(fractions.Fraction(str(ratio)) * tokens / experts
                           + fractions.Fraction(1, 2)))


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> pathlib.Path:
  return plugin_lab(tmp_path_factory, "switch_router.py")


@pytest.fixture(scope="module")
def vmoe(lab):
  """`vmoe <args>` in the lab, in the one process of this module's commands that load the plug-in."""
  with vmoe_driver(lab) as driver:
    yield driver


@pytest.fixture(scope="module")
def pretrained(lab, vmoe) -> pathlib.Path:
  """A tiny V-MoE whose one MoE layer routes with the plug-in, 3 steps, each one logged."""
  return _run(vmoe, "pretrain", f"workdir={lab / 'up'}", *SWITCH, *SHORT,
              f"model.router.z_loss_weight={Z_LOSS_WEIGHT}", "train.log_every_steps=1")


def test_pretrain_records_the_plugin_and_logs_its_losses(pretrained):
  config = _config(pretrained)
  assert config["plugins"] == ["switch_router"]
  router = config["model"]["router"]
  assert router["type"] == "switch" and router["z_loss_weight"] == Z_LOSS_WEIGHT
  assert router["capacity_ratio"] == 1.05  # the family's default
  train = _train_records(pretrained)
  assert [r["step"] for r in train] == [1, 2, 3]
  for r in train:
    balance = r["moe/layer_1/load_balancing_loss"]
    z_loss = r["moe/layer_1/z_loss"]
    assert 0 < balance <= EXPERTS and z_loss > 0
    # The family's auxiliary loss (aux_loss_weight) and the z-loss the model adds (its weight).
    assert r["moe/layer_1/auxiliary_loss"] == pytest.approx(balance, rel=1e-5)
    assert r["train/aux_loss"] == pytest.approx(r["moe/layer_1/auxiliary_loss"], rel=1e-6)
    assert r["train/z_loss"] == pytest.approx(Z_LOSS_WEIGHT * z_loss, rel=1e-5)
    assert r["train/loss"] == pytest.approx(
        r["train/cls_loss"] + 0.01 * r["train/aux_loss"] + r["train/z_loss"], rel=1e-5)
    assert 0 <= r["moe/layer_1/fraction_dropped_tokens"] < 1
  params = _params(pretrained)["block_1"]["moe"]["router"]
  assert set(params) == {"dense"} and params["dense"]["kernel"].shape == (32, EXPERTS)


# Runs the plug-in's Flax module on fixed tokens (as `python -c`, in the process of the commands
# that load the plug-in); saves the tokens, the gate kernel and the metrics in train and eval mode.
_ROUTER_SCRIPT = """
import sys

import jax
import numpy as np

import switch_router
from runner.models.moe import routers

x = 3 * np.random.default_rng(0).standard_normal((3, 20, 6)).astype(np.float32)
router = switch_router.SwitchRouter(num_experts=4, capacity_ratio=0.8, eval_capacity_ratio=1.5,
                                    z_loss_weight=0.3)
variables = router.init(jax.random.PRNGKey(0), x, train=True)
out = {"x": x, "kernel": np.asarray(variables["params"]["dense"]["kernel"])}
for mode, train in (("train", True), ("eval", False)):
  plan, metrics = router.apply(variables, x, train=train)
  out[f"{mode}/capacity"] = np.asarray(plan.capacity)
  metrics, losses = routers.split_losses(metrics)  # and the losses it hands over, weighted
  out[f"{mode}/z_loss_weight"] = np.asarray(losses["z_loss"])
  out.update({f"{mode}/{k}": np.asarray(v) for k, v in metrics.items()})
np.savez(sys.argv[1], **out)
"""


def _switch_reference(x, kernel, ratio: float) -> dict:
  """Switch routing and its losses in float64 NumPy: top-1 by gate, round(S * C / E) slots
  (half up), tokens kept in token order; E * sum(f * P) per group, mean(logsumexp^2)."""
  groups, tokens, _ = x.shape
  experts = kernel.shape[1]
  logits = x.astype(np.float64) @ kernel.astype(np.float64)
  top = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  gates = np.exp(logits - lse[..., None])
  choice = gates.argmax(-1)  # (G, S)
  capacity = _switch_capacity(tokens, experts, ratio)
  kept = np.zeros((groups, tokens), bool)
  filled = np.zeros((groups, experts))
  for g in range(groups):
    for s in range(tokens):
      if filled[g, choice[g, s]] < capacity:
        filled[g, choice[g, s]] += 1
        kept[g, s] = True
  f = np.eye(experts)[choice].mean(1)  # (G, E): the share of tokens choosing each expert
  balance = (experts * (f * gates.mean(1)).sum(-1)).mean()
  z_loss = np.mean(lse ** 2)
  return {"capacity": capacity, "load_balancing_loss": balance, "z_loss": z_loss,
          "auxiliary_loss": balance,
          "fraction_dropped_tokens": 1 - kept.mean(),
          "expert_load": filled.mean(0) / capacity}


def test_switch_router_metrics_match_numpy(vmoe, tmp_path):
  """The plug-in's losses as the papers define them: Switch's E * sum_i f_i P_i (Fedus et al.,
  Eq. 4) and ST-MoE's z-loss (Zoph et al., Eq. 5), on tokens whose logits are large enough for
  the z-loss to matter; and its drops at the train and the eval capacity ratio."""
  out = tmp_path / "router.npz"
  code, _, err = vmoe("-c", _ROUTER_SCRIPT, str(out))
  assert code == 0, err[-3000:]
  got = dict(np.load(out))
  for mode, ratio in (("train", 0.8), ("eval", 1.5)):
    expected = _switch_reference(got["x"], got["kernel"], ratio)
    assert int(got[f"{mode}/capacity"]) == expected.pop("capacity")
    for name, value in expected.items():
      np.testing.assert_allclose(got[f"{mode}/{name}"], value, rtol=1e-5, atol=1e-6,
                                 err_msg=f"{mode}/{name}")
  # 60 tokens over 4 experts of 4 slots per group of 20 drop some; 8 slots drop (almost) none.
  assert got["train/fraction_dropped_tokens"] > got["eval/fraction_dropped_tokens"]
  assert got["train/z_loss"] > 1
  assert float(got["train/z_loss_weight"]) == float(got["eval/z_loss_weight"]) == 0.3


def test_eval_measures_the_plugin_router(lab, vmoe, pretrained):
  """Without plugins=: the stage loads the plug-ins its checkpoint's run recorded, says so, and
  records them as its own."""
  workdir = lab / "eval"
  code, _, err = vmoe("eval", f"init.checkpoint={pretrained}",
                      f"workdir={workdir}", *QUIET, "eval.capacity_sweep=[1.0,0.5]",
                      "eval.adversarial.epsilons=[0.01]", "eval.adversarial.steps=2",
                      "eval.adversarial.max_examples=16", "eval.routing_analysis=true")
  assert code == 0, err[-3000:]
  assert (f"vmoe eval: loading the plug-ins {pretrained} was trained with: "
          "plugins=[switch_router]") in err
  assert _config(workdir)["plugins"] == ["switch_router"]
  s = _summary(workdir)
  assert 0 <= s["mnist5k/prec@1"] <= 1
  # FLOPs and active parameters ask the family: one expert per token.
  assert s["compute/gflops_per_image"] > 0 and s["compute/gflops_per_image_analytic"] > 0
  assert s["compute/params_active"] < s["compute/params_total"]
  # The analytic count, recounted from the architecture: the ViT of the same sizes with the MoE
  # layer's dense MLP (T rows of 2 x 2 D M) replaced by the gates, 2 T D E, and the experts at
  # padded capacity, E * round(S C / E) rows per routing group of S = G T tokens (top-1: the
  # Switch rule, not token-choice's k = 2 of vmoe_tiny's config). vmoe_tiny here: T = 16 patches
  # + the class token, groups of G = 8 images, E = 8, C = 1.05: 18 rows per image, 17 at C = 1,
  # 9 at C = 0.5.
  config = _config(workdir)
  model = config["model"]
  assert (model["moe"]["group_size"], model["moe"]["num_experts"], model["moe"]["layers"],
          model["router"]["capacity_ratio"], model["router"]["eval_capacity_ratio"],
          model["classifier"]) == (8, EXPERTS, [1], 1.05, None, "token")
  batch = (config["eval"]["batch_size"] or config["data"]["eval_batch_size"]
           or config["data"]["batch_size"])
  tokens, d, m, group = 17, model["hidden_size"], model["mlp_dim"], min(8, batch)
  rows = {c: EXPERTS * _switch_capacity(group * tokens, EXPERTS, c) / group
          for c in (1.05, 1.0, 0.5)}
  analytic = (dense_twin_flops(model, num_classes=10) + 2 * tokens * d * EXPERTS
              + 2 * 2 * d * m * (rows[1.05] - tokens))
  assert s["compute/gflops_per_image_analytic"] * 1e9 == pytest.approx(analytic, rel=1e-12)
  # XLA's count of the compiled programs, at C = 1.05 (the main pass) and the sweep's 1 and 0.5:
  # only the expert rows differ, each costing the same (its two matmuls and their elementwise
  # work), so the counts differ in proportion to the rows Switch's rule gives each capacity (a
  # router that ran other buffers than its family counts fails here), and a row costs its matmuls
  # and at most 15 % more (measured: 8 %, the elementwise work).
  xla = {1.05: s["compute/gflops_per_image"],
         1.0: s["capacity_sweep/C_1/vanilla/gflops_per_image"],
         0.5: s["capacity_sweep/C_0.5/vanilla/gflops_per_image"]}
  per_row = (xla[1.0] - xla[0.5]) * 1e9 / (rows[1.0] - rows[0.5])
  assert (xla[1.05] - xla[1.0]) * 1e9 == pytest.approx(per_row * (rows[1.05] - rows[1.0]),
                                                       rel=1e-6)
  assert 2 * 2 * d * m <= per_row < 1.15 * 2 * 2 * d * m, per_row
  assert 0 <= s["mnist5k/pgd/eps_0.01/routing_change/layer_1"] <= 1  # a discrete router
  sweep = {"capacity_sweep/C_1/vanilla/prec@1", "capacity_sweep/C_0.5/vanilla/prec@1"}
  assert sweep <= set(s) and all(0 <= s[k] <= 1 for k in sweep)
  # The sweep asks the family for its capacity: half the slots, fewer expert FLOPs.
  assert (s["capacity_sweep/C_0.5/vanilla/gflops_per_image"]
          < s["capacity_sweep/C_1/vanilla/gflops_per_image"])
  assert not any("/bpr/" in k for k in s)  # the family does not support Batch Prioritized Routing
  got = {k.split("/", 2)[2] for k in s if k.startswith("routing/layer_1/")}
  assert got == ANALYSIS
  assert 0 <= s["routing/layer_1/uncertainty_class"] <= 1
  assert s["routing/layer_1/top1"] >= max(s["routing/layer_1/top2"], 1 / EXPERTS)
  # Top-1 routing: a token is processed by its one expert, or dropped.
  assert s["routing/layer_1/experts_per_token"] == pytest.approx(
      1 - s["routing/layer_1/dropped_fraction"], abs=1e-6)
  analysis = np.load(workdir / "routing_analysis.npz")
  assert analysis["layer_1/class_weights"].shape == (10, EXPERTS)
  for picture in ("routing_classes.png", "routing_positions.png", "routing_top_weights.png"):
    assert (workdir / picture).read_bytes()[:4] == b"\x89PNG", picture
  # The family defines no re-routing at another capacity: no dropped-patch maps.
  assert not (workdir / "routing_dropped_patches.png").exists()


def test_finetune_carries_the_router_over(lab, vmoe, pretrained):
  """Fine-tuning the plug-in's checkpoint with the plug-in (other values of its keys): the
  router's gate kernel and the experts start from the checkpoint's (one step moves them little;
  a fresh gate kernel would differ by its init scale, ~0.2)."""
  workdir = _run(vmoe, "finetune", f"workdir={lab / 'down'}", f"init.checkpoint={pretrained}",
                 *SWITCH, *SHORT, "train.steps=1", "schedule.warmup_steps=0",
                 "model.router.capacity_ratio=2.0",
                 "model.router.z_loss_weight=0.0")
  assert _summary(workdir)["step"] == 1
  router = _config(workdir)["model"]["router"]
  assert (router["type"], router["capacity_ratio"], router["z_loss_weight"]) == ("switch", 2.0, 0.0)
  [record] = _train_records(workdir)
  assert record["moe/layer_1/auxiliary_loss"] == pytest.approx(
      record["moe/layer_1/load_balancing_loss"], rel=1e-6)
  assert "train/z_loss" not in record and "moe/layer_1/z_loss" not in record  # z_loss_weight=0
  start, tuned = _params(pretrained)["block_1"]["moe"], _params(workdir)["block_1"]["moe"]
  before = np.asarray(start["router"]["dense"]["kernel"])
  after = np.asarray(tuned["router"]["dense"]["kernel"])
  assert after.shape == before.shape and np.abs(after - before).max() < 0.05
  assert np.abs(np.asarray(tuned["experts"]["fc1_kernel"])
                - np.asarray(start["experts"]["fc1_kernel"])).max() < 0.05


def test_a_stage_that_cannot_load_its_checkpoints_plugins_names_them(pretrained, tmp_path):
  """Run from a folder where the plug-in's module is not importable (a fresh process: the
  module's driver has imported it)."""
  workdir = tmp_path / "w"
  fails_clearly(vmoe_in(tmp_path, "eval", f"init.checkpoint={pretrained}", f"workdir={workdir}",
                        *QUIET),
                f"init.checkpoint={pretrained} was trained with plugins=[switch_router]",
                "cannot be loaded here", "no module named 'switch_router'")
  assert not workdir.exists()


@pytest.mark.slow  # make test-cluster runs a plug-in's sweep on SLURM and the parallel launcher
def test_multirun_over_a_plugin_key(lab, tmp_path):
  """Two jobs of the basic launcher (in one process: the plug-in loads once) both finish, each
  with its value of the plug-in's key."""
  code, _, err = vmoe_in(lab, "pretrain", "--multirun", f"workdir={tmp_path}", *SWITCH, *SHORT,
                       "model.router.z_loss_weight=0.0,0.1")
  assert code == 0, err[-3000:]
  assert "basic_launcher.BasicLauncher" in (tmp_path / "multirun.yaml").read_text()
  weights = {}
  for job in ("0", "1"):
    assert _summary(tmp_path / job)["step"] == 3
    assert (tmp_path / job / "checkpoints" / "3").exists()
    config = _config(tmp_path / job)
    assert config["plugins"] == ["switch_router"] and config["model"]["router"]["type"] == "switch"
    weight = config["model"]["router"]["z_loss_weight"]
    [r] = _train_records(tmp_path / job)
    assert r.get("train/z_loss", 0.0) == pytest.approx(
        weight * r.get("moe/layer_1/z_loss", 0.0), rel=1e-5)
    weights[job] = weight
  assert sorted(weights.values()) == [0.0, 0.1]


BROKEN = {  # module name: its source; the error is on line 3 of each
    "broken_router": '"""A plug-in that fails as it is imported."""\nimport os  # noqa\n'
                     'raise RuntimeError("boom")\n',
    "needy_router": '"""A plug-in that needs a package this machine lacks."""\n\n'
                    'import no_such_package_for_vmoe_tests  # noqa\n',
    "typo_router": '"""A plug-in that does not compile."""\n\ndef route(:\n',
}


@pytest.mark.parametrize("args, expected", [
    pytest.param([*SWITCH, "model.router.z_loss_weight=-1"],
                 ["model.router.z_loss_weight=-1", "must be >= 0"], id="bad-value"),
    pytest.param([*SWITCH, "model.router.k=1"],
                 ["model.router.k=1", "model.router.type=switch",
                  "model.router.{capacity_ratio, eval_capacity_ratio, z_loss_weight}"],
                 id="key-switch-does-not-read"),
    pytest.param(["plugins=[no_such_module]", "model.router.type=switch"],
                 ["no module named 'no_such_module'"], id="unknown-module"),
    pytest.param(["plugins=[broken_router]"],
                 ["'broken_router'", "RuntimeError: boom", "broken_router.py:3"],
                 id="module-raises"),
    pytest.param(["plugins=[needy_router]"],
                 ["'needy_router'", "'no_such_package_for_vmoe_tests'", "needy_router.py:3"],
                 id="module-needs-a-missing-package"),
    pytest.param(["plugins=[typo_router]"],
                 ["'typo_router'", "SyntaxError", "typo_router.py:3. Fix the module"],
                 id="module-does-not-compile"),
    pytest.param(["model=vmoe_tiny", "model.router.type=switch"],
                 ["model.router.type='switch'", "token_choice, experts_choice, soft"],
                 id="no-plugins"),
])
def test_bad_plugin_input_fails_before_compute(args, expected, lab, vmoe, tmp_path):
  for name, source in BROKEN.items():
    (lab / f"{name}.py").write_text(source)
  workdir = tmp_path / "w"
  # Naming no plug-in, the command must not find switch_router registered: a fresh process.
  names_one = any(a.startswith("plugins=") for a in args)
  command = ("pretrain", f"workdir={workdir}", *SHORT, *args)
  message = fails_clearly(vmoe(*command) if names_one else vmoe_in(lab, *command), *expected)
  assert "Traceback" not in message
  nothing_like_a_run(workdir)
  assert not workdir.exists()
