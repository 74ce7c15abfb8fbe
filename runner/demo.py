"""`make demo`: pretrain -> fine-tune -> eval on the embedded offline data, then a results table.

Runs the real `vmoe` subcommands in this process (so the XLA cache and imports are shared) and
writes the chain's `vmoe report` pages; rerunning resumes finished stages, so it reprints the
table in seconds. Extra arguments go to every stage (e.g. `logger.wandb.mode=disabled`)."""
from __future__ import annotations

import json
import pathlib
import sys
import time

from runner import cli, report
from runner.command import allocator
from runner.report import summarize

ROOT = pathlib.Path("runs/demo")
# The demo's budget (5 minutes from a cold start on 2 CPU cores): MNIST at its own 28 px (7 x 7
# patches of 4, a quarter fewer tokens than vmoe_tiny's 32 px), 160 upstream steps of 128 images
# and 80 downstream steps of 64 (about 4 epochs of the UCI digits) instead of the configs' 220 and
# 120. Fine-tuning and its from-scratch baseline compile the same programs (the persistent XLA
# cache serves the second).
UPSTREAM = ["model.image_size=28", "train.steps=160", "eval.every_steps=80",
            "checkpoint.every_steps=80"]
DOWNSTREAM = ["model.image_size=28", "train.steps=80", "eval.every_steps=40",
              "checkpoint.every_steps=40"]
STAGES = [
    # (name, subcommand, overrides)
    ("pretrain", "pretrain", [f"workdir={ROOT}/pretrain", *UPSTREAM]),
    ("finetune", "finetune", [f"workdir={ROOT}/finetune", f"init.checkpoint={ROOT}/pretrain",
                              *DOWNSTREAM]),
    ("scratch", "finetune", [f"workdir={ROOT}/scratch", "init.checkpoint=null", *DOWNSTREAM]),
    # A partitioned batch ensemble (E³): the same upstream V-MoE fine-tuned as 2 members of 4
    # experts each, K=1; then evaluated as one ensemble with the V-MoE fine-tune.
    ("pbe", "finetune", [f"workdir={ROOT}/pbe", f"init.checkpoint={ROOT}/pretrain",
                         "model.moe.ensemble_size=2", "model.router.k=1", *DOWNSTREAM]),
    ("fewshot", "fewshot", [f"workdir={ROOT}/fewshot", f"init.checkpoint={ROOT}/pretrain",
                            "fewshot.datasets=[uci_digits]", "fewshot.shots=[1,5,10,25]"]),
    ("eval", "eval", [f"workdir={ROOT}/eval", f"init.checkpoint={ROOT}/finetune",
                      "eval.ood_datasets=[lfw_faces]",
                      "eval.corruptions=[gaussian_noise,contrast]",
                      "eval.severities=[1,3,5]", "eval.capacity_sweep=[1.05,0.5,0.25,0.1]",
                      "eval.routing_analysis=true"]),
    ("eval_bpr", "eval", [f"workdir={ROOT}/eval_bpr", f"init.checkpoint={ROOT}/finetune",
                          "model.router.capacity_ratio=0.5", "model.router.batch_priority=true"]),
    ("ensemble", "ensemble", [f"workdir={ROOT}/ensemble",
                              f"init.checkpoint=[{ROOT}/pbe,{ROOT}/finetune]"]),
]


def _summary(name: str) -> dict:
  return json.loads((ROOT / name / "summary.json").read_text())


def table(seconds: dict[str, float]) -> str:
  rows = []
  for name, title, dataset in (("pretrain", "pretrain vmoe_tiny, 28 px", "mnist5k"),
                               ("finetune", "finetune from pretrain", "uci_digits"),
                               ("scratch", "finetune from scratch (baseline)", "uci_digits"),
                               ("pbe", "finetune pBE (K=1, M=2) from pretrain", "uci_digits")):
    s = _summary(name)
    rows.append((title, dataset, s["step"], s["val/prec@1"], s.get("test/prec@1"),
                 s.get("test/nll"), seconds.get(name)))
  for name, title in (("eval", "eval suite, C=1.05 vanilla routing"),
                      ("eval_bpr", "eval, C=0.5 Batch Prioritized Routing"),
                      ("ensemble", "ensemble: pBE + V-MoE fine-tunes")):
    s = _summary(name)
    rows.append((title, "uci_digits test", "-", None, s["uci_digits/prec@1"], s["uci_digits/nll"],
                 seconds.get(name)))
  fmt = lambda v: "-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))
  header = ["stage", "data", "steps", "val prec@1", "test prec@1", "test NLL", "seconds"]
  body = [[name, data, steps, fmt(val), fmt(test), fmt(nll), "-" if sec is None else f"{sec:.0f}"]
          for name, data, steps, val, test, nll, sec in rows]
  return summarize.markdown(header, body) + "\n\n" + measurements()


def measurements() -> str:
  """The fine-tuned model beyond accuracy, and few-shot transfer of the pretrained one."""
  ev, shots, ens = _summary("eval"), _summary("fewshot"), _summary("ensemble")
  ds, ood = "uci_digits", "uci_digits_vs_lfw_faces"
  few = ", ".join(f"{s}-shot {shots[f'{ds}/{s}shot/accuracy']:.3f}" for s in (1, 5, 10, 25))
  sweep = ", ".join(
      f"C={c}: {ev[f'capacity_sweep/C_{c}/vanilla/prec@1']:.3f} / "
      f"{ev[f'capacity_sweep/C_{c}/bpr/prec@1']:.3f} at "
      f"{ev[f'capacity_sweep/C_{c}/bpr/gflops_per_image'] * 1e3:.2f} MFLOPs"
      for c in ("1.05", "0.5", "0.25", "0.1"))
  rows = [
      ("calibration (uci_digits test)", f"ECE {ev[f'{ds}/ece']:.4f} (15 bins), Brier "
       f"{ev[f'{ds}/brier']:.4f}, NLL {ev[f'{ds}/nll']:.4f}"),
      ("far OOD: LFW crops (lfw_faces)", f"AUROC MSP {ev[f'{ood}/msp/auroc']:.3f}, entropy "
       f"{ev[f'{ood}/entropy/auroc']:.3f}, Mahalanobis {ev[f'{ood}/mahalanobis/auroc']:.3f}; "
       f"FPR@95 Mahalanobis {ev[f'{ood}/mahalanobis/fpr95_in_positive']:.3f} (in-dist "
       f"positive), {ev[f'{ood}/mahalanobis/fpr95_ood_positive']:.3f} (OOD positive)"),
      ("corruptions (noise, contrast x severities 1,3,5)", f"mean error "
       f"{ev[f'{ds}/corruption/mean/error']:.4f} vs clean {ev[f'{ds}/error']:.4f}, mean ECE "
       f"{ev[f'{ds}/corruption/mean/ece']:.4f}"),
      ("compute", f"{ev['compute/gflops_per_image'] * 1e3:.2f} MFLOPs/image (XLA), "
       f"{ev['compute/params_active']:,} of {ev['compute/params_total']:,} parameters active, "
       f"{ev['compute/images_per_s']:.0f} images/s"),
      ("capacity sweep, prec@1 vanilla / BPR", sweep),
      ("routing analysis (the fine-tuned V-MoE, uci_digits test; U: routed assignments)",
       routing(ev)),
      ("few-shot (pretrained, uci_digits)", few),
      ("ensemble of the pBE's 2 members and the V-MoE (3 members)",
       f"ECE {ens[f'{ds}/ece']:.4f} vs {ev[f'{ds}/ece']:.4f} for the V-MoE alone; members' "
       f"mean NLL {ens[f'{ds}/member_mean/nll']:.4f}, ensemble NLL {ens[f'{ds}/nll']:.4f}; "
       f"diversity: KL {ens[f'{ds}/diversity/kl']:.4f}, disagreement "
       f"{ens[f'{ds}/diversity/disagreement']:.4f}; "
       f"{ens['compute/gflops_per_image'] * 1e3:.2f} MFLOPs/image"),
  ]
  return summarize.markdown(["measurement", "result"], rows)


def routing(ev: dict) -> str:
  """Per MoE layer: how much the class determines the expert (U(E|C) of the processed
  assignments), the mean TOP-1 and TOP-2 weights, and the dropped tokens."""
  layers = sorted({k.split("/")[1] for k in ev if k.startswith("routing/layer_")},
                  key=lambda name: int(name.split("_")[1]))
  return "; ".join(
      f"{layer}: U(E∣class) {ev[f'routing/{layer}/uncertainty_class_routed']:.3f}, "
      f"U(E∣position) {ev[f'routing/{layer}/uncertainty_position_routed']:.3f}, top-1 / top-2 "
      f"weight {ev[f'routing/{layer}/top1']:.2f} / {ev[f'routing/{layer}/top2']:.2f}, dropped "
      f"{ev[f'routing/{layer}/dropped_fraction']:.3f}" for layer in layers)


def main(extra: list[str]) -> int:
  seconds = {}
  for name, sub, overrides in STAGES:
    print(f"\n=== vmoe {sub} {' '.join(overrides + extra)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
      # The chain's page writes every stage's page once at the end (not each stage, then again).
      code = cli.main([sub] + overrides + ["logger.report=false"] + extra)
    except SystemExit as e:
      code = e.code
    if code:
      print(f"demo: stage {name} failed (exit {code})", file=sys.stderr)
      return int(code) if isinstance(code, int) else 1
    seconds[name] = time.perf_counter() - start
  results = table(seconds)
  (ROOT / "results.md").write_text(results + "\n")
  start = time.perf_counter()
  page = report.write_chain_page(ROOT, runs=[ROOT / name for name, _, _ in STAGES])[-1]
  print("\n" + results + f"\n\n(also in {ROOT / 'results.md'}; total "
        f"{sum(seconds.values()):.0f} s)\nOne page for the whole chain, each stage's page linked "
        f"from it (vmoe report, {time.perf_counter() - start:.0f} s): {page}")
  return 0


if __name__ == "__main__":
  allocator.pause_collector()  # as `vmoe` starts; the first stage's job resumes it
  sys.exit(main(sys.argv[1:]))
