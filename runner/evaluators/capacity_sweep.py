"""Accuracy against inference compute over expert capacity ratios (the V-MoE paper's Figure 6).

At inference, lowering the capacity ratio C drops tokens and saves expert FLOPs; Batch Prioritized
Routing chooses which tokens to drop by their routing score, so it degrades more gracefully than
vanilla routing. Each row of a sweep is one (C, routing) evaluation.
"""
from __future__ import annotations

import json


def sweep_key(capacity_ratio: float, batch_priority: bool) -> str:
  return f"capacity_sweep/C_{capacity_ratio:g}/{'bpr' if batch_priority else 'vanilla'}"


def write_sweep_json(rows: list[dict], path: str) -> str:
  with open(path, "w") as f:
    json.dump(rows, f, indent=2)
  return path


def plot_capacity_sweep(rows: list[dict], path: str, metric: str = "prec@1", title: str = "") -> str:
  """One line per routing (vanilla, BPR): `metric` against GFLOPs per image, points labelled by C."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  figure = Figure(figsize=(6, 4.5), dpi=100)
  FigureCanvasAgg(figure)
  axes = figure.add_subplot()
  for bpr, style in ((False, "o--"), (True, "s-")):
    points = sorted((r["gflops_per_image"], r[metric], r["capacity_ratio"]) for r in rows
                    if r["batch_priority"] == bpr)
    if not points:
      continue
    x, y, c = zip(*points)
    axes.plot(x, y, style, label="Batch Prioritized Routing" if bpr else "vanilla routing")
    for xi, yi, ci in points:
      axes.annotate(f"C={ci:g}", (xi, yi), textcoords="offset points", xytext=(4, -10), fontsize=8)
  axes.set_xlabel("GFLOPs per image (XLA cost analysis)")
  axes.set_ylabel(metric)
  axes.grid(alpha=0.3)
  axes.legend(loc="best")
  axes.set_title(title or f"{metric} vs inference compute")
  figure.tight_layout()
  figure.savefig(path, format="png")
  return path
