"""Mapping a checkpoint's parameters onto a (possibly different) model for fine-tuning.

docs/training.md states the rules (a new head, resized position embeddings, dense_to_experts,
another router family's routers left out: `new_router`, or `routers_fit` for a checkpoint without
a config). Besides: a class token the model lacks is left out; a balance bias the checkpoint lacks
starts at zeros, one the model lacks is refused with a hint. Everything else is copied and must
match in shape; all mismatches are reported together, by parameter name, before any training."""
from __future__ import annotations

import numpy as np
import jax

from runner.errors import CheckpointError
from runner.models import drop_upcycling

_ROUTER = "/moe/router/"  # the scope of an MoE layer's router parameters
_BIAS = _ROUTER + "balance_bias"  # auxiliary-loss-free balancing's (runner/models/moe/balance.py)
_EXPERT_FROM_DENSE = {"fc1_kernel": "fc1/kernel", "fc1_bias": "fc1/bias",
                      "fc2_kernel": "fc2/kernel", "fc2_bias": "fc2/bias"}
_REINIT_HINT = "set init.reinit_head=true for a new number of classes or head type"


def flatten(tree) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(str(getattr(k, "key", k)) for k in path): v for path, v in leaves}


def unflatten(flat: dict[str, np.ndarray]) -> dict:
  tree: dict = {}
  for name, value in flat.items():
    node = tree
    *parents, leaf = name.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def routers_fit(restored, family) -> bool:
  """Whether a checkpoint's routers have `family`'s parameters (`router_parameters`), so that they
  can initialise its routers; true without routers (a ViT)."""
  names = {name.split(_ROUTER, 1)[1] for name in flatten(restored) if _ROUTER in name}
  return not names or names == set(family.router_parameters)


def resize_position_embedding(posemb: np.ndarray, num_tokens: int) -> np.ndarray:
  """(1, n*n, D) -> (1, m*m, D) by corner-aligned linear interpolation of the n x n grid, as
  big_vision's `resample_posemb` and vmoe's `VitZoomTransformation`: `scipy.ndimage.zoom(grid,
  (m/n, m/n, 1), order=1)`, whose default grid mode keeps the four corners exactly (new cell j
  samples old position j * (n-1) / (m-1)). Computed in float64, returned in the input's dtype."""
  from scipy import ndimage  # only fine-tuning at a new resolution needs it

  _, old, dim = posemb.shape
  old_side, new_side = int(round(old ** 0.5)), int(round(num_tokens ** 0.5))
  if old_side ** 2 != old or new_side ** 2 != num_tokens:
    raise ValueError(f"position embeddings of {old} -> {num_tokens} tokens are not square grids")
  grid = np.asarray(posemb, np.float64).reshape(old_side, old_side, dim)
  resized = ndimage.zoom(grid, (new_side / old_side, new_side / old_side, 1), order=1)
  if resized.shape != (new_side, new_side, dim):  # zoom rounds the output size
    raise ValueError(f"zooming a {old_side}x{old_side} grid gave {resized.shape[:2]}, not "
                     f"{new_side}x{new_side}")
  return resized.astype(posemb.dtype).reshape(1, num_tokens, dim)


def _dense_source(name: str) -> str | None:
  """'block_1/moe/experts/fc1_kernel' -> 'block_1/mlp/fc1/kernel'."""
  parts = name.split("/")
  if len(parts) == 4 and parts[1:3] == ["moe", "experts"] and parts[3] in _EXPERT_FROM_DENSE:
    return f"{parts[0]}/mlp/{_EXPERT_FROM_DENSE[parts[3]]}"
  return None


def _drop_upcycle(out: dict, old: dict, ratio: float, seed: int) -> None:
  """Drop-upcycles in place every block whose experts `out` filled from a dense MLP of `old`."""
  for name in [n for n in out if n.endswith("/moe/experts/fc1_kernel") and _dense_source(n) in old]:
    prefix = name.rsplit("/", 1)[0]
    block = int(name.split("/")[0].rsplit("_", 1)[-1])
    names = {k: f"{prefix}/{k}" for k in _EXPERT_FROM_DENSE}
    dropped = drop_upcycling.drop_upcycle({k: out[n] for k, n in names.items()}, ratio,
                                          np.random.default_rng([seed, block]))
    out.update({n: dropped[k] for k, n in names.items()})


def _head_counterpart(name: str) -> str | None:
  """A linear head's parameter for a heteroscedastic head's mean classifier, and back:
  'head/loc_layer/kernel' <-> 'head/kernel'."""
  parts = name.split("/")
  if parts[:2] == ["head", "loc_layer"] and len(parts) == 3:
    return f"head/{parts[2]}"
  if parts[0] == "head" and len(parts) == 2:
    return f"head/loc_layer/{parts[1]}"
  return None


def adapt_params(restored, fresh, *, reinit_head: bool = True, dense_to_experts: bool = False,
                 new_router: bool = False, source: str = "checkpoint",
                 drop_upcycling: tuple[float, int] = (0.0, 0)):
  """Parameters shaped like `fresh` (a freshly initialised tree), filled from `restored`.
  `drop_upcycling` (ratio, seed): with `dense_to_experts`, each MoE block's experts copied from a
  dense MLP are drop-upcycled, seeded by (seed, block): independent of devices and block order.
  Keeping the head (`reinit_head=False`) across head types maps a linear head onto a
  heteroscedastic head's mean classifier (and back); the noise parameters start fresh."""
  old, new = flatten(restored), flatten(fresh)
  out, problems, used = {}, [], set()
  linear_head = "head/kernel" in old
  if new_router:
    used.update(n for n in old if _ROUTER in n)
  for name, target in new.items():
    shape = tuple(np.shape(target))
    if (new_router and _ROUTER in name) or (reinit_head and name.startswith("head/")):
      out[name] = np.asarray(target)
      used.add(name)
      continue
    old_name = name  # the checkpoint's parameter that fills it
    if name.startswith("head/") and name not in old:
      if (counterpart := _head_counterpart(name)) in old:
        old_name = counterpart
      elif linear_head or name.endswith("pre_sigmoid_temperature"):
        out[name] = np.asarray(target)  # a new heteroscedastic head's noise layers, a learned τ
        continue
    if old_name in old:
      value = np.asarray(old[old_name])
      used.add(old_name)
      if value.shape == shape:
        out[name] = value
      elif name.endswith("pos_embedding") and value.shape[-1] == shape[-1]:
        try:
          out[name] = resize_position_embedding(value, shape[1])
        except ValueError as e:
          problems.append(f"{name}: {e}")
      else:
        hint = f" ({_REINIT_HINT})" if name.startswith("head/") else ""
        other = "" if old_name == name else f"{old_name} "
        problems.append(f"{name}: checkpoint {other}{value.shape} vs model {shape}{hint}")
      continue
    dense = _dense_source(name)
    if dense_to_experts and dense in old:
      value = np.asarray(old[dense])
      used.add(dense)
      if (shape[0],) + value.shape != shape:
        problems.append(f"{name}: dense {dense} {value.shape} cannot fill experts of shape {shape}")
      else:
        out[name] = np.broadcast_to(value, shape).copy()
      continue
    # A router dense_to_experts adds, or the bias of a checkpoint balanced otherwise (zeros).
    if (dense_to_experts and _ROUTER in name) or name.endswith(_BIAS):
      out[name] = np.asarray(target)
      continue
    if dense is not None and dense in old:
      problems.append(f"{name}: missing in the checkpoint, which has a dense MLP here "
                      "(set init.dense_to_experts=true to copy it into every expert)")
    else:
      problems.append(f"{name}: missing in the checkpoint")
  # A new head replaces the whole upstream head, representation (pre_logits) layer included; a
  # model that pools its tokens (gap, map; Soft MoE models) leaves a class token behind.
  dropped = ("head/", "pre_logits/") if reinit_head else ("head/",)
  if "cls" not in new:
    dropped += ("cls",)
  unused = sorted(n for n in old if n not in used and not n.startswith(dropped))
  problems += [f"{n}: in the checkpoint but not in the model"
               + (" (its routers balanced with a bias: set model.router.balance=bias)"
                  if n.endswith(_BIAS) else "") for n in unused]
  ratio, seed = drop_upcycling
  if ratio and not problems:
    _drop_upcycle(out, old, ratio, seed)
  problems.sort(key=lambda p: (" vs model " not in p, p))  # shape mismatches first
  if problems:
    more = f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
    raise CheckpointError(f"the {source} does not fit the model ({len(problems)} parameter(s)): "
                          f"{'; '.join(problems[:6])}{more}.")
  return unflatten(out)
