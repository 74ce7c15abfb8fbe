"""A run's metrics.jsonl as curves, and the rule that keeps long ones small.

Each logged key becomes a curve over the steps that logged it: scalars (train/loss) as one value
per step, lists (moe/layer_1/expert_load, one value per expert) as a steps x entries matrix. A
page draws at most MAX_POINTS points per curve: a longer one as the means of buckets of
consecutive logged steps (a point's step is its bucket's mean step). Means keep the trend and the
level; a spike within a bucket is smoothed, which is why the page names the bucket size."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import numpy as np

MAX_POINTS = 2000
# A per-layer key: [<prefix>/]moe/layer_<i>/<name>.
LAYER = re.compile(r"(?:(.+)/)?moe/layer_(\d+)/(.+)")


@dataclasses.dataclass
class Curve:
  steps: np.ndarray  # (n,)
  values: np.ndarray  # (n,) for a scalar, (n, entries) for a list
  bucket: int = 1  # logged steps per point (1: every logged step is shown)

  def __len__(self) -> int:
    return len(self.steps)


@dataclasses.dataclass
class Curves:
  """Every curve of a run, by its key; `logged` counts the records read."""
  scalars: dict[str, Curve]
  lists: dict[str, Curve]
  logged: int = 0
  last_step: int | None = None


def read(path: pathlib.Path) -> Curves:
  """The curves of a metrics.jsonl (empty ones when the file is missing)."""
  scalars: dict[str, tuple[list, list]] = {}
  lists: dict[str, tuple[list, list]] = {}
  logged = 0
  last = None
  if path.exists():
    with open(path) as lines:
      for line in lines:
        if not line.strip():
          continue
        try:
          record = json.loads(line)
          step = int(record["step"])
        except (ValueError, KeyError, TypeError):  # a live run's last line may be half written
          continue
        logged += 1
        last = step if last is None else max(last, step)
        for key, value in record.items():
          if key == "step":
            continue
          if _number(value) and math.isfinite(value):
            scalars.setdefault(key, ([], []))
            scalars[key][0].append(step)
            scalars[key][1].append(float(value))
          elif isinstance(value, list) and value and all(_number(v) for v in value):
            lists.setdefault(key, ([], []))
            lists[key][0].append(step)
            lists[key][1].append(value)
  return Curves({k: Curve(np.asarray(s, float), np.asarray(v, float))
                 for k, (s, v) in scalars.items()},
                {k: _matrix(s, v) for k, (s, v) in lists.items()}, logged, last)


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _matrix(steps: list, rows: list[list]) -> Curve:
  """The rows of the most common length (a resumed run may have changed the expert count;
  the page shows the longest consistent record rather than mixing shapes)."""
  lengths = [len(r) for r in rows]
  width = max(set(lengths), key=lengths.count)
  keep = [i for i, n in enumerate(lengths) if n == width]
  return Curve(np.asarray([steps[i] for i in keep], float),
               np.asarray([[float(x) if math.isfinite(x) else np.nan for x in rows[i]]
                           for i in keep], float))


def downsample(curve: Curve, max_points: int = MAX_POINTS) -> Curve:
  """At most `max_points` points: the means of buckets of ceil(n / max_points) consecutive
  points (steps and values alike); a short curve is returned as it is."""
  n = len(curve)
  if n <= max_points:
    return curve
  size = math.ceil(n / max_points)
  starts = np.arange(0, n, size)
  counts = np.diff(np.append(starts, n))
  steps = np.add.reduceat(curve.steps, starts) / counts
  values = np.add.reduceat(curve.values, starts, axis=0)
  values = values / (counts if curve.values.ndim == 1 else counts[:, None])
  return Curve(steps, values, bucket=size * curve.bucket)


@dataclasses.dataclass
class LoadMap:
  """One MoE layer's list-valued curve (its expert load) as drawn: downsampled, and whether its
  values are fractions in [0, 1] (then dead and saturated experts are marked)."""
  key: str
  name: str  # what the values are (expert_load)
  logged: Curve  # every logged step
  drawn: Curve  # at most MAX_POINTS
  fraction: bool


def load_maps(curves: Curves) -> list[LoadMap]:
  """The per-layer lists of a run (the experts' load), layer by layer."""
  keys = sorted((k for k in curves.lists if LAYER.fullmatch(k)),
                key=lambda k: (LAYER.fullmatch(k)[1] or "", int(LAYER.fullmatch(k)[2])))
  maps = []
  for key in keys:
    drawn = downsample(curves.lists[key])
    fraction = bool(np.nanmin(drawn.values) >= 0 and np.nanmax(drawn.values) <= 1)
    maps.append(LoadMap(key, LAYER.fullmatch(key)[3], curves.lists[key], drawn, fraction))
  return maps
