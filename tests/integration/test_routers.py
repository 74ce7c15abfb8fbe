"""Every stage with each router family, through the real CLI: experts-choice and Soft MoE models
pretrain, fine-tune (from their own run, from a token-choice V-MoE and from a dense ViT, keeping
the experts and starting a new router), few-shot, eval (PGD, GFLOPs, capacity sweep where it
means something) and ensemble. Token-choice is covered by test_end_to_end.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from architecture_flops import dense_twin_flops
from conftest import QUIET, TINY_MODEL

pytestmark = pytest.mark.xdist_group("routers")

SHORT = [*QUIET, "train.steps=3", "schedule.warmup_steps=0", "data.batch_size=16",
         "eval.every_steps=0",
         "checkpoint.every_steps=0", "model.moe.layers=[1]"]


def _summary(workdir) -> dict:
  return json.loads((workdir / "summary.json").read_text())


def _params(workdir):
  from runner.checkpoints import weights
  return weights.load(str(workdir))[0]


@pytest.fixture(scope="module")
def upstream(shared_run, tmp_path_factory):
  """Tiny experts-choice and Soft MoE runs, 3 steps each; a token-choice V-MoE (2 steps) and a
  dense ViT (1 step). All but the experts-choice one are the session's shared runs (read, never
  written; what the tests take from the V-MoE and the ViT, experts to start from and an ensemble
  member, does not depend on their steps)."""
  from runner import cli
  root = tmp_path_factory.mktemp("routers")
  runs = {"ecmoe_tiny": root / "ecmoe_tiny", "softmoe_tiny": shared_run("softmoe_3steps"),
          "vmoe_tiny": shared_run("vmoe_2steps"), "vit_tiny": shared_run("vit_1step")}
  assert cli.main(["pretrain", "model=ecmoe_tiny", f"workdir={runs['ecmoe_tiny']}", *TINY_MODEL,
                   *SHORT]) == 0
  return root, runs


@pytest.mark.parametrize("name,router", [("ecmoe_tiny", "experts_choice"),
                                         ("softmoe_tiny", "soft")])
def test_pretrain_records_the_routers_metrics(upstream, name, router):
  _, runs = upstream
  config = yaml.safe_load((runs[name] / "config.yaml").read_text())
  assert config["model"]["router"]["type"] == router
  records = [json.loads(line) for line in (runs[name] / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if "train/loss" in r][-1]
  assert train["moe/layer_1/auxiliary_loss"] == 0.0
  if router == "experts_choice":
    assert 0 <= train["moe/layer_1/experts_per_token_min"] <= 1.0 <= train[
        "moe/layer_1/experts_per_token_max"]
    assert 0 < train["moe/layer_1/fraction_processed_tokens"] <= 1
  else:
    assert train["moe/layer_1/fraction_dropped_tokens"] == 0.0
    params = _params(runs[name])["block_1"]["moe"]["router"]
    # softmoe_tiny: GAP, 4x4 patches of a 16 px image, 8 experts, C = 1: P = round(16/8) = 2.
    assert params["mu"].shape == (32, 8, 2) and params["scale"].shape == ()


@pytest.mark.parametrize("name,origin", [("softmoe_tiny", "vmoe_tiny"),
                                         ("ecmoe_tiny", "vmoe_tiny"),
                                         ("softmoe_tiny", "vit_tiny"),
                                         pytest.param("ecmoe_tiny", "ecmoe_tiny",
                                                      marks=pytest.mark.slow)])
def test_finetune_keeps_the_experts_and_starts_a_new_router(upstream, tmp_path, run_cli, name,
                                                            origin):
  _, runs = upstream
  extra = ["init.dense_to_experts=true"] if origin == "vit_tiny" else []
  down = tmp_path / "down"
  code, _, err = run_cli("finetune", f"model={name}", f"workdir={down}",
                         f"init.checkpoint={runs[origin]}", *TINY_MODEL, *SHORT, *extra,
                         "train.steps=1", "schedule.warmup_steps=0")
  assert code == 0, err
  assert _summary(down)["step"] == 1
  # The experts are the checkpoint's (every one a copy of the dense MLP for a ViT), bit for bit:
  # the new head starts at zero, so the first step's gradient reaches the head alone and leaves
  # the experts as they were loaded. Nothing looser tells them from a fresh init: the upstream
  # runs start from seed 0 too, and a fresh experts-choice or Soft MoE init at the fine-tune's
  # seed 0 is within 0.0012 of vmoe_tiny's experts (2 steps from that same init). That the router
  # starts anew: test_model_transfer.py.
  from runner.checkpoints import weights
  start = weights.load(str(runs[origin]))[0]["block_1"]
  tuned = np.asarray(_params(down)["block_1"]["moe"]["experts"]["fc1_kernel"])
  experts = np.asarray(start["mlp"]["fc1"]["kernel"] if origin == "vit_tiny" else
                       start["moe"]["experts"]["fc1_kernel"])
  np.testing.assert_array_equal(tuned, np.broadcast_to(experts, tuned.shape))


@pytest.mark.parametrize("name", ["ecmoe_tiny", "softmoe_tiny"])
def test_fewshot_eval_and_ensemble(upstream, tmp_path, run_cli, name):
  _, runs = upstream
  code, _, err = run_cli("fewshot", f"init.checkpoint={runs[name]}", f"workdir={tmp_path / 'fs'}",
                         *QUIET, "fewshot.shots=[1]", "fewshot.seeds=[0]")
  assert code == 0, err
  assert 0 <= _summary(tmp_path / "fs")["uci_digits/1shot/accuracy"] <= 1

  sweep = ["eval.capacity_sweep=[1.0,0.5]"] if name == "ecmoe_tiny" else []
  code, _, err = run_cli("eval", f"init.checkpoint={runs[name]}", f"workdir={tmp_path / 'ev'}",
                         *QUIET, "eval.adversarial.epsilons=[0.01]", "eval.adversarial.steps=2",
                         "eval.adversarial.max_examples=16", *sweep)
  assert code == 0, err
  ev = _summary(tmp_path / "ev")
  assert 0 <= ev["mnist5k/prec@1"] <= 1
  assert ev["compute/gflops_per_image"] > 0
  # Groups of one image (T = 16 tokens, no class token) among E = 8 experts at capacity ratio 1:
  # experts-choice gives each expert T / E = 2 tokens, Soft MoE P = 2 slots per expert, so the
  # E * 2 = T expert rows of layer 1 cost what its dense MLP did, and the MoE layer adds only its
  # router: the gates 2 T D E, or Soft MoE's logits, dispatch and combine, 3 x 2 T D (E P).
  model = yaml.safe_load((tmp_path / "ev" / "config.yaml").read_text())["model"]
  assert (model["moe"]["group_size"], model["moe"]["num_experts"], model["moe"]["layers"],
          model["router"]["capacity_ratio"], model["classifier"]) == (1, 8, [1], 1.0, "gap")
  tokens, d, e = 16, model["hidden_size"], 8
  router = 2 * tokens * d * e if name == "ecmoe_tiny" else 3 * 2 * tokens * d * (e * 2)
  analytic = dense_twin_flops(model, num_classes=10) + router
  assert ev["compute/gflops_per_image_analytic"] * 1e9 == pytest.approx(analytic, rel=1e-12)
  change = "mnist5k/pgd/eps_0.01/routing_change/layer_1"
  if name == "ecmoe_tiny":
    assert 0 <= ev[change] <= 1  # the experts that picked each token
    assert {"capacity_sweep/C_1/vanilla/prec@1", "capacity_sweep/C_0.5/vanilla/prec@1"} <= set(ev)
    assert not any("/bpr/" in k for k in ev)  # BPR is a token-choice notion
    # Active parameters: each token uses E * C / tokens experts on average (here C = 1: one).
    assert ev["compute/params_active"] < ev["compute/params_total"]
  else:
    assert change not in ev  # every token reaches every slot: no discrete routing to change
    assert ev["compute/params_active"] == ev["compute/params_total"]

  code, _, err = run_cli("ensemble", f"init.checkpoint=[{runs[name]},{runs['vmoe_tiny']}]",
                         f"workdir={tmp_path / 'ens'}", *QUIET)
  assert code == 0, err
  assert _summary(tmp_path / "ens")["ensemble/size"] == 2
