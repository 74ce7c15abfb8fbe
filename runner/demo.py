"""`make demo`: pretrain -> fine-tune -> eval on the embedded offline data, then a results table.

Runs the real `vmoe` subcommands one after another in this process (so the XLA cache and imports
are shared) and prints a Markdown table of what they measured. Rerunning resumes finished stages
from their checkpoints, so it reprints the same table in seconds. Extra arguments are passed to
every stage (e.g. `python -m runner.demo logger.wandb.mode=disabled`).
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

from runner import cli

ROOT = pathlib.Path("runs/demo")
STAGES = [
    # (name, subcommand, overrides)
    ("pretrain", "pretrain", [f"workdir={ROOT}/pretrain"]),
    ("finetune", "finetune", [f"workdir={ROOT}/finetune", f"init.checkpoint={ROOT}/pretrain"]),
    ("scratch", "finetune", [f"workdir={ROOT}/scratch", "init.checkpoint=null"]),
    ("eval", "eval", [f"workdir={ROOT}/eval", f"init.checkpoint={ROOT}/finetune"]),
    ("eval_bpr", "eval", [f"workdir={ROOT}/eval_bpr", f"init.checkpoint={ROOT}/finetune",
                          "model.router.capacity_ratio=0.5", "model.router.batch_priority=true"]),
]


def _summary(name: str) -> dict:
  return json.loads((ROOT / name / "summary.json").read_text())


def table(seconds: dict[str, float]) -> str:
  pre, fine, scratch = _summary("pretrain"), _summary("finetune"), _summary("scratch")
  ev, bpr = _summary("eval"), _summary("eval_bpr")
  rows = [
      ("pretrain vmoe_tiny", "mnist5k", pre["step"], pre["val/prec@1"], pre.get("test/prec@1"),
       pre.get("test/nll"), seconds.get("pretrain")),
      ("finetune from pretrain", "uci_digits", fine["step"], fine["val/prec@1"],
       fine.get("test/prec@1"), fine.get("test/nll"), seconds.get("finetune")),
      ("finetune from scratch (baseline)", "uci_digits", scratch["step"], scratch["val/prec@1"],
       scratch.get("test/prec@1"), scratch.get("test/nll"), seconds.get("scratch")),
      ("eval, C=1.05 vanilla routing", "uci_digits test", "-", None, ev["uci_digits/prec@1"],
       ev["uci_digits/nll"], seconds.get("eval")),
      ("eval, C=0.5 Batch Prioritized Routing", "uci_digits test", "-", None,
       bpr["uci_digits/prec@1"], bpr["uci_digits/nll"], seconds.get("eval_bpr")),
  ]
  fmt = lambda v: "-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))
  lines = ["| stage | data | steps | val prec@1 | test prec@1 | test NLL | seconds |",
           "|---|---|---|---|---|---|---|"]
  for name, dataset, steps, val, test, nll, sec in rows:
    lines.append(f"| {name} | {dataset} | {steps} | {fmt(val)} | {fmt(test)} | {fmt(nll)} | "
                 f"{'-' if sec is None else f'{sec:.0f}'} |")
  return "\n".join(lines)


def main(extra: list[str]) -> int:
  seconds = {}
  for name, sub, overrides in STAGES:
    print(f"\n=== vmoe {sub} {' '.join(overrides + extra)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
      code = cli.main([sub] + overrides + extra)
    except SystemExit as e:
      code = e.code
    if code:
      print(f"demo: stage {name} failed (exit {code})", file=sys.stderr)
      return int(code) if isinstance(code, int) else 1
    seconds[name] = time.perf_counter() - start
  report = table(seconds)
  (ROOT / "results.md").write_text(report + "\n")
  print("\n" + report + f"\n\n(also in {ROOT / 'results.md'}; total {sum(seconds.values()):.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
