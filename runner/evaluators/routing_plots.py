"""The routing analysis' pictures (runner/evaluators/routing_analysis.py; docs/routing-analysis.md),
as PNG files: one figure per kind, one panel per analysed layer (and member). Reads only what the
analysis hands over; bare Agg figures, no pyplot state."""
from __future__ import annotations

import math
import pathlib

import numpy as np


def _figure(width: float, height: float):
  # lazily: matplotlib is slow to import, and only a run that draws needs it
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  figure = Figure(figsize=(width, height), dpi=100)
  FigureCanvasAgg(figure)
  return figure


def _save(figure, path: pathlib.Path) -> str:
  figure.tight_layout()
  figure.savefig(str(path), format="png")
  return str(path)


def _panels(n: int, columns: int = 4) -> tuple[int, int]:
  columns = max(1, min(columns, n))
  return math.ceil(n / columns), columns


def _order(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(row order, column order) that puts each row's favourite column on a diagonal-ish band:
  columns by the mean position of the rows that prefer them, rows by their favourite column then
  by how strongly they prefer it (the paper orders each panel for the structure to show)."""
  favourite = matrix.argmax(1)
  strength = matrix.max(1)
  # The argsort of an order (a permutation) is each item's place in that order.
  rank = np.argsort(np.lexsort((-strength, favourite)))
  score = [rank[favourite == j].mean() if np.any(favourite == j) else len(rank) + j
           for j in range(matrix.shape[1])]
  cols = np.argsort(score, kind="stable")
  rows = np.lexsort((-strength, np.argsort(cols)[favourite]))
  return rows, cols


def classes(analysed: dict, path: pathlib.Path) -> str:
  rows, cols = _panels(len(analysed))
  figure = _figure(3.2 * cols, 3.0 * rows)
  for i, (key, a) in enumerate(analysed.items()):
    matrix = a["arrays"]["class_weights"]
    order_rows, order_cols = _order(matrix)
    axes = figure.add_subplot(rows, cols, i + 1)
    image = axes.imshow(matrix[order_rows][:, order_cols], aspect="auto", cmap="viridis",
                        interpolation="nearest")
    figure.colorbar(image, ax=axes, fraction=0.046)
    routed = a["scalars"].get("uncertainty_class_routed")
    axes.set_title(f"{key}\nU(E|C) = {a['scalars']['uncertainty_class']:.3f}"
                   + ("" if routed is None else f", routed {routed:.3f}"), fontsize=9)
    axes.set_xlabel("expert (reordered)", fontsize=8)
    axes.set_ylabel("class (reordered)", fontsize=8)
    if len(order_cols) <= 32:  # small enough to name every expert and class
      axes.set_xticks(range(len(order_cols)), [str(e) for e in order_cols], fontsize=6)
    if len(order_rows) <= 32:
      axes.set_yticks(range(len(order_rows)), [str(c) for c in order_rows], fontsize=6)
  return _save(figure, path)


def positions(analysed: dict, grid: dict, path: pathlib.Path) -> str:
  """For each layer one row of per-expert maps over the patch grid: how often the expert
  processes the token at each patch (token- and experts-choice), or its mean weight there (Soft
  MoE), each expert on the layer's common scale."""
  keys = list(analysed)
  experts = max(a["arrays"]["position_weights"].shape[1] for a in analysed.values())
  figure = _figure(1.3 * experts + 1, 1.5 * len(keys))
  for r, key in enumerate(keys):
    arrays, scalars = analysed[key]["arrays"], analysed[key]["scalars"]
    p = arrays.get("position_processed", arrays["position_weights"])  # (patches, E)
    h, w = grid[key]
    vmax = float(p.max()) or 1.0
    for e in range(p.shape[1]):
      axes = figure.add_subplot(len(keys), experts, r * experts + e + 1)
      axes.imshow(p[:, e].reshape(h, w), cmap="magma", vmin=0, vmax=vmax, interpolation="nearest")
      axes.set(xticks=[], yticks=[])
      if e == 0:
        routed = scalars.get("uncertainty_position_routed")
        axes.set_ylabel(f"{key}\nU(E|S)={scalars['uncertainty_position']:.3f}"
                        + ("" if routed is None else f"\nrouted {routed:.3f}"), fontsize=7)
      if r == 0:
        axes.set_title(f"expert {e}", fontsize=7)
  return _save(figure, path)


def top_weights(analysed: dict, path: pathlib.Path) -> str:
  rows, cols = _panels(len(analysed))
  figure = _figure(3.2 * cols, 2.6 * rows)
  for i, (key, a) in enumerate(analysed.items()):
    hist = a["arrays"]["top_histogram"]  # (k, bins)
    edges = a["arrays"]["top_bins"]
    centres = (np.arange(hist.shape[1]) + 0.5) * (edges[1] - edges[0])
    axes = figure.add_subplot(rows, cols, i + 1)
    for j, counts in enumerate(hist, start=1):
      axes.step(centres, counts / max(counts.sum(), 1.0), where="mid",
                label=f"TOP-{j} (mean {a['scalars'][f'top{j}']:.2f})")
    axes.set_title(key, fontsize=9)
    axes.set_xlabel("routing weight", fontsize=8)
    axes.set_ylabel("fraction of tokens", fontsize=8)
    axes.set_xlim(0, 1)
    axes.legend(fontsize=7)
  return _save(figure, path)


def _picture(image: np.ndarray) -> np.ndarray:
  """An image in [0, 1] to draw: uint8 pixels as they crossed to the device, or float model
  inputs in value_range(-1, 1)'s range."""
  if image.dtype == np.uint8:
    return image.astype(np.float64) / 255
  return np.clip((image.astype(np.float64) + 1) / 2, 0, 1)


def dropped(drops: dict, sample: dict, info, images: int, path: pathlib.Path, title: str) -> str:
  """Rows: capacity ratios; columns: the first images, vanilla and BPR side by side; white
  patches are the tokens no expert processes (the paper's Figure 5)."""
  settings = sorted({k.split("/")[0] for k in drops}, key=lambda c: -float(c))
  kinds = sorted({k.split("/")[1] for k in drops}, key=lambda k: k != "vanilla")
  shown = min(images, sample["image"].shape[0])
  figure = _figure(max(4.0, 1.4 * shown * len(kinds) + 0.5), 1.5 * len(settings) + 0.6)
  h, w = info.grid
  first_patch = info.first_patch
  for r, c in enumerate(settings):
    for j, kind in enumerate(kinds):
      mask = drops[f"{c}/{kind}"]  # (images, tokens)
      for i in range(shown):
        picture = _picture(np.asarray(sample["image"][i]))
        ph, pw = picture.shape[0] // h, picture.shape[1] // w
        gone = mask[i, first_patch:first_patch + h * w].reshape(h, w)
        for y, x in zip(*np.nonzero(gone)):
          picture[y * ph:(y + 1) * ph, x * pw:(x + 1) * pw] = 1.0
        axes = figure.add_subplot(len(settings), shown * len(kinds),
                                  r * shown * len(kinds) + j * shown + i + 1)
        axes.imshow(picture if picture.shape[-1] == 3 else picture[..., 0], cmap="gray",
                    interpolation="nearest")
        axes.set(xticks=[], yticks=[])
        if i == 0:
          axes.set_title(f"C={c} {kind}", fontsize=7)
  figure.suptitle(title, fontsize=9)
  return _save(figure, path)


def experts_per_token(analysed: dict, grid: dict, path: pathlib.Path) -> str:
  keys = [k for k, a in analysed.items() if "experts_per_token_position" in a["arrays"]]
  figure = _figure(6.0, 2.6 * len(keys))
  for r, key in enumerate(keys):
    a = analysed[key]["arrays"]
    axes = figure.add_subplot(len(keys), 2, 2 * r + 1)
    image = axes.imshow(a["experts_per_token_position"].reshape(grid[key]), cmap="viridis",
                        interpolation="nearest")
    figure.colorbar(image, ax=axes, fraction=0.046)
    axes.set_title(f"{key}: mean experts per patch", fontsize=8)
    axes.set(xticks=[], yticks=[])
    axes = figure.add_subplot(len(keys), 2, 2 * r + 2)
    hist = a["experts_per_token_histogram"]
    axes.bar(np.arange(len(hist)), hist / max(hist.sum(), 1.0))
    axes.set_xlabel("experts processing a token", fontsize=8)
    axes.set_ylabel("fraction of tokens", fontsize=8)
  return _save(figure, path)


def soft_slots(analysed: dict, grid: dict, path: pathlib.Path, slots: int = 16) -> str:
  keys = [k for k, a in analysed.items() if "slot_position_weights" in a["arrays"]]
  figure = _figure(1.2 * slots + 1, 1.4 * len(keys))
  for r, key in enumerate(keys):
    weights = analysed[key]["arrays"]["slot_position_weights"]  # (slots, patches)
    for n in range(min(slots, weights.shape[0])):
      axes = figure.add_subplot(len(keys), slots, r * slots + n + 1)
      axes.imshow(weights[n].reshape(grid[key]), cmap="magma", interpolation="nearest")
      axes.set(xticks=[], yticks=[])
      if n == 0:
        axes.set_ylabel(f"{key}\nH(comb.)="
                        f"{analysed[key]['scalars']['combine_entropy']:.2f}", fontsize=7)
      if r == 0:
        axes.set_title(f"slot {n}", fontsize=7)
  return _save(figure, path)


def draw_all(analysed: dict, drops: dict, sample, out_dir, *, images: int, first_layer, infos
             ) -> dict[str, str]:
  """Every picture that applies; returns {W&B key: PNG path}. `infos`: the `LayerInfo` of every
  analysed key and of `first_layer`."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  grid = {key: infos[key].grid for key in analysed}
  out = {"routing/classes": classes(analysed, out_dir / "routing_classes.png"),
         "routing/positions": positions(analysed, grid, out_dir / "routing_positions.png"),
         "routing/top_weights": top_weights(analysed, out_dir / "routing_top_weights.png")}
  if drops and sample is not None and images:
    out["routing/dropped_patches"] = dropped(
        drops, sample, infos[first_layer], images, out_dir / "routing_dropped_patches.png",
        title=f"{first_layer}: dropped patches (white) by capacity ratio")
  if per_token := {k: a for k, a in analysed.items() if "experts_per_token" in infos[k].views
                   and "experts_per_token_position" in a["arrays"]}:
    out["routing/experts_per_token"] = experts_per_token(
        per_token, grid, out_dir / "routing_experts_per_token.png")
  if mixing := {k: a for k, a in analysed.items() if "slot_mixing" in infos[k].views}:
    out["routing/soft_slots"] = soft_slots(mixing, grid, out_dir / "routing_soft_slots.png")
  return out


def compressed_experts(layers: dict, method: str, path: pathlib.Path) -> str:
  """`vmoe compress`'s picture: per MoE layer, the share of the calibration tokens' choices each
  expert had, coloured by the new expert it went into (grey: pruned), and below, the shares the
  compressed model's experts get on the same images. `layers`: {layer: (chosen (E,), plan,
  chosen after (E',))}."""
  from matplotlib import colormaps  # lazily, as _figure
  rows = len(layers)
  figure = _figure(7.0, 2.4 * rows)
  colours = colormaps["tab20"]
  for i, (layer, (chosen, plan, after)) in enumerate(layers.items()):
    shares = np.asarray(chosen, float) / max(float(np.sum(chosen)), 1.0)
    new_of = {e: j for j, group in enumerate(plan) for e in group}
    axes = figure.add_subplot(rows, 2, 2 * i + 1)
    axes.bar(range(len(shares)), shares,
             color=[colours(new_of[e] % 20) if e in new_of else "0.8" for e in range(len(shares))])
    axes.set_title(f"{layer}: before ({method})", fontsize=9)
    axes.set(xlabel="expert", ylabel="share of choices")
    after_shares = np.asarray(after, float) / max(float(np.sum(after)), 1.0)
    axes = figure.add_subplot(rows, 2, 2 * i + 2)
    axes.bar(range(len(after_shares)), after_shares,
             color=[colours(j % 20) for j in range(len(after_shares))])
    axes.set_title(f"{layer}: after", fontsize=9)
    axes.set_xlabel("new expert")
    axes.set_xticks(range(len(after_shares)), ["+".join(map(str, g)) for g in plan], fontsize=7)
  return _save(figure, path)
