"""What a calibration set's routing says about each MoE layer's experts, for `vmoe compress`.

One pass over the calibration images, in inference mode: per layer, how many tokens chose each
expert (before the buffers' capacity drops any: the router's preference, what Lu et al. count),
how many it processed, the routing weight each received, and, for merging, every expert applied
to every token of the layer's input and averaged over the tokens (HC-SMoE's expert outputs).
Padded images of the last batch count for nothing."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from runner.config.preprocessing import DEVICE_VALUE_RANGE
from runner.models import compression, inputs, introspection
from runner.models.activations import DEFAULT
from runner.models.moe.experts import apply_experts
from runner.models.moe.layer import MoeMlpBlock

# What the interceptor sows: a MoE layer's input tokens and its output.
_INPUTS, _OUTPUTS = "calibration_inputs", "calibration_outputs"


@dataclasses.dataclass
class LayerStats:
  """One MoE layer's statistics over the calibration set (E: its routed experts)."""
  chosen: np.ndarray  # (E,) tokens that chose each expert
  routed: np.ndarray  # (E,) of those, the ones its buffer took
  weights: np.ndarray  # (E,) the routing weight the tokens gave it, summed
  mean_outputs: np.ndarray | None  # (E, D) its output averaged over every token, or None
  tokens: int  # tokens the layer saw (each member's copy counts, in a tiled ensemble)
  # With keep_io, per batch: the layer's input and output (rows, T, D) and which rows are real.
  io: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)


def _sow_io(next_fun, args, kwargs, context):
  out = next_fun(*args, **kwargs)
  if isinstance(context.module, MoeMlpBlock) and context.method_name == "__call__":
    context.module.sow("intermediates", _INPUTS, args[0])
    context.module.sow("intermediates", _OUTPUTS, out[0])
  return out


def gather(model, params, batches, *, examples: int, partitions: int, tiled: bool,
           outputs: bool, keep_io: bool = False, predictions=None,
           progress=None) -> tuple[dict[str, LayerStats], int]:
  """({"layer_<i>": LayerStats}, images seen) over the first `examples` real images of `batches`
  (dicts of image, labels, _mask, and the value range the device applies: runner/models/inputs.py);
  each batch's logits also go to `predictions` (runner.evaluators.predictions.PredictionStats).
  `partitions`, `tiled`: a partitioned batch ensemble's layout (runner/models/moe/layer.py).
  `keep_io`: every layer's inputs and outputs kept for `reconstruction_errors` (host memory)."""
  activation = (getattr(model, "moe", None) or {}).get("activation", DEFAULT)  # the experts'

  @jax.jit
  def step(params, batch, mask):
    with nn.intercept_methods(_sow_io):
      logits, _, records = introspection.apply_with_routing(model, params, inputs.images(batch),
                                                            train=False)
    out = {}
    for layer, r in records.items():
      token_mask = mask[:, None, None].astype(jnp.float32)
      out[layer] = {"chosen": (r["expert_mask"] * token_mask).sum((0, 1)),
                    "routed": (r["routed_mask"] * token_mask).sum((0, 1)),
                    "weights": (r["expert_weights"] * token_mask).sum((0, 1)),
                    "tokens": token_mask.sum() * r["expert_mask"].shape[1]}
      if outputs:
        out[layer]["outputs"], out[layer]["counted"] = _output_sums(
            params, layer, r[_INPUTS], mask, partitions, tiled, activation)
      if keep_io:
        out[layer]["io"] = (r[_INPUTS], r[_OUTPUTS])
    return logits, out

  params = jax.device_put(params)  # once: host arrays would cross to the device every batch
  totals: dict[str, dict] = {}
  seen = 0
  for batch in batches:
    mask = np.asarray(batch["_mask"]).copy()
    mask[np.cumsum(mask) > examples - seen] = False
    if not mask.any():
      break
    logits, sums = step(params, {k: v for k, v in batch.items()
                                 if k in ("image", DEVICE_VALUE_RANGE)}, mask)
    if predictions is not None:
      predictions.update({"mask": mask, "logits": logits, "labels": batch["labels"]})
    seen += int(mask.sum())
    for layer, values in sums.items():
      into = totals.setdefault(layer, {"io": []})
      if keep_io:
        x, y = (np.asarray(v) for v in values.pop("io"))
        into["io"].append((x, y, np.repeat(mask, len(x) // len(mask))))
      for k, v in values.items():
        into[k] = into.get(k, 0) + np.asarray(v, np.float64)
    if progress:
      progress(seen)
    if seen >= examples:
      break
  stats = {layer: LayerStats(
      chosen=t["chosen"], routed=t["routed"], weights=t["weights"], tokens=int(t["tokens"]),
      io=t["io"],
      mean_outputs=t["outputs"] / np.maximum(t["counted"], 1)[:, None] if outputs else None)
           for layer, t in totals.items()}
  return stats, seen


def _output_sums(params, layer: str, x: jax.Array, mask: jax.Array, partitions: int,
                 tiled: bool, activation: str) -> tuple[jax.Array, jax.Array]:
  """((E, D), (E,)): each expert's output summed over its partition's real tokens; their count."""
  experts = params[f"block_{layer.rsplit('_', 1)[-1]}"][introspection.MOE_LAYER]["experts"]
  weights = tuple(experts[k] for k in compression.EXPERT_PARAMS)
  e = weights[0].shape[0] // partitions
  sums, counts = [], []
  for p in range(partitions):
    rows = x[p::partitions] if tiled and partitions > 1 else x
    images, tokens, dim = rows.shape
    row_mask = jnp.repeat(mask, images // mask.shape[0]).astype(jnp.float32)
    buffer = rows.reshape(1, 1, images * tokens, dim)

    def summed(expert):  # one expert at a time: (tokens, hidden) alive, not (E, tokens, hidden)
      y = apply_experts(tuple(w[None] for w in expert), buffer, activation=activation)
      y = y.reshape(images, tokens, dim)
      return jnp.einsum("itd,i->d", y, row_mask)
    sums.append(jax.lax.map(summed, tuple(w[p * e:(p + 1) * e] for w in weights)))
    counts.append(jnp.full((e,), row_mask.sum() * tokens))
  return jnp.concatenate(sums), jnp.concatenate(counts)


def reconstruction_errors(block: dict, io: list, candidates) -> list[float]:
  """Lu et al.'s criterion for each candidate (the layer's parameters with fewer experts, all of
  one shape): the squared distance between the layer's output with all its experts and with the
  candidate's, summed over the real images' tokens of `io` (`LayerStats.io`), relative to the
  former's squared norm. `block`: MoeMlpBlock's keyword arguments for the candidates' experts."""
  layer = MoeMlpBlock(**block)

  @jax.jit
  def error(candidate, x, y, rows):
    new, _ = layer.apply({"params": candidate}, x, train=False)
    weight = rows.astype(jnp.float32)[:, None]
    return (((new - y) ** 2).sum(-1) * weight).sum(), ((y ** 2).sum(-1) * weight).sum()

  io = jax.device_put(io)  # once, not once per candidate
  out = []
  for candidate in candidates:
    candidate, total, norm = jax.device_put(candidate), 0.0, 0.0
    for x, y, rows in io:
      e, n = error(candidate, x, y, rows)
      total, norm = total + float(e), norm + float(n)
    out.append(total / max(norm, 1e-30))
  return out
