"""The evaluators' PNGs: bare Agg figures, not pyplot, so no global backend or figure state changes
(safe in headless runs and inside other programs' plotting)."""


def new_figure(width: float, height: float):
  # lazily: matplotlib is slow to import, and only a run that draws needs it
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  figure = Figure(figsize=(width, height), dpi=100)
  FigureCanvasAgg(figure)
  return figure


def save_png(figure, path: str) -> str:
  figure.tight_layout()
  figure.savefig(path, format="png")
  return path
