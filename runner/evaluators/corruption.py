"""Robustness to corruptions (`eval.corruptions` x `eval.severities`): every eval dataset read
again with a CIFAR-10-C corruption inserted into its preprocessing (runner/data/corruptions.py);
error, NLL and ECE per corruption and severity, their means over severities and corruptions."""
from __future__ import annotations

import dataclasses
from typing import List

import numpy as np

from runner.config import preprocessing
from runner.config.checks import Choice, Items, Range, key
from runner.config.relations import relation
from runner.config.schema import EvalSuiteConfig
from runner.data import corruptions as corruptions_lib
from runner.evaluators import predictions, suite as suite_lib


def corrupted_pp(pp: str, name: str, severity: int) -> str:
  """`pp` with the corruption inserted before value_range (corruptions work on [0, 255])."""
  ops = [op.strip() for op in pp.split("|") if op.strip()]
  at = next((i for i, op in enumerate(ops) if op.startswith("value_range")), len(ops))
  return "|".join(ops[:at] + [f"corrupt({name!r}, {int(severity)})"] + ops[at:])


def corruption_names(names: list[str]) -> list[str]:
  """eval.corruptions with [all] expanded (the names are checked by the schema)."""
  return list(corruptions_lib.CORRUPTIONS) if list(names) == ["all"] else list(names)


def _corruption_names() -> list[str]:
  """Those runner/data/corruptions.py registers, read when a value is checked."""
  return [*preprocessing.CORRUPTIONS.names(), "all"]


@dataclasses.dataclass
class CorruptionKeys:
  corruptions: List[str] = key([], Items(Choice(_corruption_names)), "or [all]")
  severities: List[int] = key([1, 2, 3, 4, 5], Items(Range(1, 5), example="[1,3,5]"))


@relation
def corruptions_have_severities(eval: EvalSuiteConfig):
  if eval.corruptions and not eval.severities:
    return ("eval.severities is empty but eval.corruptions names corruptions: give severities "
            "from 1 to 5, e.g. eval.severities=[1,3,5].")


class Evaluator(suite_lib.Evaluator):
  name = "corruptions"
  enabling_key = "eval.corruptions"
  Keys = CorruptionKeys

  def run(self) -> suite_lib.Result:
    s, e = self.suite, self.suite.config
    names, severities = corruption_names(e.corruptions), list(e.severities)
    summary = {}
    for ds in s.datasets:
      per_corruption = {}
      for name in names:
        prefix, rows = f"{ds.name}/corruption/{name}", []
        for severity in severities:
          stats = predictions.PredictionStats(loss_name=s.loss_name, ece_bins=e.ece_bins)
          s.evaluate(s.batches(ds, pp=corrupted_pp(ds.config.pp, name, severity)), stats,
                     f"{ds.name} {name} severity {severity}")
          m = stats.metrics("")
          rows.append({k: m[f"/{k}"] for k in ("error", "nll", "ece")})
          summary.update({f"{prefix}/sev_{severity}/{k}": v for k, v in rows[-1].items()})
        per_corruption[name] = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        summary.update({f"{prefix}/{k}": v for k, v in per_corruption[name].items()})
      for k in ("error", "nll", "ece"):
        summary[f"{ds.name}/corruption/mean/{k}"] = float(
            np.mean([m[k] for m in per_corruption.values()]))
    return suite_lib.Result(summary=summary)
