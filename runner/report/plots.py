"""The pages' charts, drawn by matplotlib as SVG text to inline in the HTML.

SVG from matplotlib, not a JavaScript charting library: no script bundle, no network, small (a
2,000-point curve is some 50 kB), and the same in any browser or printed. Heat maps are raster
images inside the SVG (a `data:` PNG), which keeps a steps x experts map small. Bare Agg figures,
no pyplot state; matplotlib, slow to import, is imported on the first chart."""
from __future__ import annotations

import io
import itertools
import math
import re

import numpy as np

# Every SVG of a page gets its own salt, so the ids matplotlib derives from it (clip paths,
# markers) do not clash between the SVGs of one document.
_salt = itertools.count()
# Below and above these an expert counts as dead or saturated on the load heat maps.
DEAD, SATURATED = 0.01, 0.99
_PROLOGUE = re.compile(
    r"<\?xml.*?\?>|<!DOCTYPE.*?>|<metadata>.*?</metadata>|\s+xmlns(:\w+)?=\"[^\"]*\"", re.DOTALL)


def _figure(width: float = 5.0, height: float = 3.0, left: float = 0.8, bottom: float = 0.5):
  """A figure with fixed margins in inches (a constrained layout costs 2.5x the drawing)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  figure = Figure(figsize=(width, height), dpi=100)
  FigureCanvasAgg(figure)
  figure.subplots_adjust(left=left / width, right=1 - 0.15 / width, bottom=bottom / height,
                         top=1 - 0.3 / height)
  return figure


def _plain(text) -> str:
  """A key or value from a run's files as literal text (a `$` would start matplotlib's math)."""
  return str(text).replace("$", r"\$")


def svg(figure) -> str:
  """The figure as an <svg> element to inline (no XML prologue, no metadata, no namespaces:
  the HTML parser gives inline SVG its namespaces)."""
  import matplotlib
  out = io.StringIO()
  with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"vmoe{next(_salt)}"}):
    figure.savefig(out, format="svg", metadata={"Creator": None, "Date": None,
                                                 "Format": None, "Type": None})
  return _PROLOGUE.sub("", out.getvalue()).strip()


def lines(title: str, series: list[tuple[str, np.ndarray, np.ndarray]], ylabel: str = "",
          log: bool = False) -> str:
  """A line per (label, steps, values); a short series (a validation curve) gets markers."""
  figure = _figure()
  axes = figure.add_subplot()
  for label, steps, values in series:
    marker = "o" if len(steps) <= 60 else None
    axes.plot(steps, values, "-", marker=marker, markersize=3, linewidth=1.2, label=_plain(label))
  if log and all(np.all(v > 0) for _, _, v in series):
    axes.set_yscale("log")
  axes.set_title(_plain(title), fontsize=10)
  axes.set_xlabel("step")
  if ylabel:
    axes.set_ylabel(_plain(ylabel))
  axes.grid(alpha=0.3)
  axes.tick_params(labelsize=8)
  if len(series) > 1:
    axes.legend(fontsize=7, ncols=2 if len(series) > 6 else 1)
  return svg(figure)


def heatmap(title: str, steps: np.ndarray, matrix: np.ndarray, label: str,
            fraction: bool = True) -> str:
  """Steps (x) by entries (y, one per expert) as SVG; see `heatmap_figure`."""
  return svg(heatmap_figure(title, steps, matrix, label, fraction))


def heatmap_figure(title: str, steps: np.ndarray, matrix: np.ndarray, label: str,
                   fraction: bool = True):
  """Steps (x) by entries (y, one per expert); for fractions in [0, 1] the colours stop short
  of both ends, so a dead expert (< DEAD) shows black and a saturated one (> SATURATED) red."""
  import matplotlib
  figure = _figure(6.4, 1.6 + 0.07 * min(matrix.shape[1], 64), left=0.6)
  axes = figure.add_subplot()
  half = (steps[-1] - steps[0]) / (len(steps) - 1) / 2 if len(steps) > 1 else 0.5
  extent = (steps[0] - half, steps[-1] + half, matrix.shape[1] - 0.5, -0.5)
  if fraction:
    cmap = matplotlib.colormaps["Blues"].with_extremes(under="black", over="#d62728", bad="#bbbbbb")
    image = axes.imshow(matrix.T, aspect="auto", interpolation="nearest", cmap=cmap,
                        vmin=DEAD, vmax=SATURATED, extent=extent)
    bar = figure.colorbar(image, ax=axes, extend="both", fraction=0.04, pad=0.01)
  else:
    image = axes.imshow(matrix.T, aspect="auto", interpolation="nearest", extent=extent)
    bar = figure.colorbar(image, ax=axes, fraction=0.04, pad=0.01)
  bar.set_label(_plain(label), fontsize=8)
  axes.set_title(_plain(title), fontsize=10)
  axes.set_xlabel("step")
  axes.set_ylabel("expert")
  if matrix.shape[1] <= 16:
    axes.set_yticks(range(matrix.shape[1]))
  axes.tick_params(labelsize=7)
  return figure


def scatter(title: str, xs: list[str], ys: list[float], xlabel: str, ylabel: str,
            best: int | None = None) -> str:
  """Every job a point, the mean per value a line (log x for positive numbers spanning a
  decade or more, as `vmoe summarize` plots), the best job a star."""
  numeric = all(_number(x) is not None for x in xs)
  order = sorted(set(xs), key=lambda x: _number(x) if numeric else x)
  position = {x: (_number(x) if numeric else i) for i, x in enumerate(order)}
  figure = _figure(4.6, 3.2, bottom=0.5 if numeric else 0.8)
  axes = figure.add_subplot()
  axes.plot([position[x] for x in xs], ys, "o", alpha=0.6, label="job")
  means = [float(np.mean([y for x2, y in zip(xs, ys) if x2 == x])) for x in order]
  axes.plot([position[x] for x in order], means, "-", color="black", linewidth=1, label="mean")
  if best is not None:
    axes.plot([position[xs[best]]], [ys[best]], "*", color="#d62728", markersize=12, label="best")
  spread = [position[x] for x in order]
  if numeric and min(spread) > 0 and max(spread) >= 10 * min(spread):
    axes.set_xscale("log")
  if not numeric:
    axes.set_xticks(range(len(order)), [_plain(x) for x in order], rotation=20, fontsize=7)
  axes.set_title(_plain(title), fontsize=10)
  axes.set_xlabel(_plain(xlabel))
  axes.set_ylabel(_plain(ylabel))
  axes.grid(alpha=0.3)
  axes.legend(fontsize=7)
  return svg(figure)


def _number(text) -> float | None:
  try:
    value = float(text)
  except (TypeError, ValueError):
    return None
  return value if math.isfinite(value) else None
