"""summary.json as tables, one per prefix: val/, test/, each eval dataset, routing/, compute/...

A flat dict of "section/name" is hard to read beyond a few dozen keys; grouped by section it reads
like the stage's printout. Per-layer or per-member keys (routing/layer_1/top1) get a column per
layer and a row per measurement: layers side by side, as in the README's routing row."""
from __future__ import annotations

import math
import re

from runner.report import markup

FIRST = ("val", "test")  # then the eval datasets and the other sections, as summary.json has them
LAST = ("routing", "compute", "moe", "train", "params")
_PER = re.compile(r"(layer|member)_\d+")
_LIST_SHOWN = 16  # list values (a per-expert load) show this many entries, then a count


def tables(summary: dict) -> str:
  groups: dict[str, dict] = {}
  for key, value in summary.items():
    section, slash, rest = str(key).partition("/")
    groups.setdefault(section if slash else "", {})[rest if slash else key] = value
  order = ([g for g in FIRST if g in groups]
           + [g for g in groups if g and g not in FIRST and g not in LAST]
           + [g for g in LAST if g in groups] + ([""] if "" in groups else []))
  parts = []
  for name in order:
    title = f"{name}/" if name else "other"
    parts.append(f"<h3>{markup.esc(title)}</h3>{_table(groups[name])}")
  return "\n".join(parts)


def rows(summary: dict) -> list[list]:
  """summary.json as (section, metric, value) rows, values as the page shows them (W&B's table)."""
  keys = [(str(key).partition("/"), value) for key, value in summary.items()]
  return [[section if slash else "", rest if slash else section, fmt(value)]
          for (section, slash, rest), value in keys]


def _table(values: dict) -> str:
  per, plain = {}, {}
  for key, value in values.items():
    head, slash, rest = key.partition("/")
    if slash and _PER.fullmatch(head):
      per.setdefault(head, {})[rest] = value
    else:
      plain[key] = value
  out = ""
  if plain:
    out += markup.table(["metric", "value"], [[k, fmt(v)] for k, v in plain.items()])
  if per:  # a column per layer (or member), a row per measurement: layers are the fewer
    names = list(dict.fromkeys(m for row in per.values() for m in row))
    out += markup.table(["metric", *per], [[m, *(fmt(row.get(m, "-")) for row in per.values())]
                                           for m in names])
  return f'<div class="wide">{out}</div>'


def fmt(value) -> str:
  """A number as the stage's printout shows it: 4 decimals, or 4 significant digits where
  those would hide it; a list as its first entries."""
  if isinstance(value, bool) or value is None:
    return str(value)
  if isinstance(value, int):
    return f"{value:,}" if abs(value) >= 10000 else str(value)
  if isinstance(value, float):
    if not math.isfinite(value):
      return str(value)
    return f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.4g}"
  if isinstance(value, list):
    shown = " ".join(fmt(float(v)) if isinstance(v, (int, float)) else str(v)
                     for v in value[:_LIST_SHOWN])
    more = f" … ({len(value)} in all)" if len(value) > _LIST_SHOWN else ""
    return f"[{shown}{more}]"
  return str(value)
