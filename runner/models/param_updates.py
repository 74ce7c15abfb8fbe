"""Parameters that the train step sets after the optimizer, by a rule of their own, from what the
model sows in training (e.g. auxiliary-loss-free balancing's bias; docs/extending.md, "State the
train step updates"). Such a value is a parameter only to be initialised, checkpointed, restored,
loaded and exported with the others; no gradient, optimizer, weight decay or clipping moves it."""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class ParamUpdate:
  """Every parameter named `param` is set after the optimizer to `rule(value before the step,
  sown)`: sown is what its module sowed in training in `collection` under the same name
  (`self.sow(collection, param, value)`, at the parameter's path), summed over the module's calls
  and the step's micro-batches. Where the module sowed nothing (it did not run in training: LiT's
  locked image tower) or `rule` is None (frozen), the parameter keeps its value before the step."""
  param: str
  collection: str
  rule: Callable[[jax.Array, jax.Array], jax.Array] | None = None


def sown_collections(updates: Sequence[ParamUpdate]) -> tuple[str, ...]:
  """The collections the objective must apply the model with mutable and return: those of the
  updates with a rule (a frozen parameter reads none)."""
  return tuple(dict.fromkeys(u.collection for u in updates if u.rule is not None))


def _names(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _sums(sown, param: str) -> dict[tuple[str, ...], jax.Array]:
  """{a parameter's path: the sum of the values sown under its name} (each call's value is an
  entry of a tuple below the name)."""
  sums: dict[tuple[str, ...], jax.Array] = {}
  for path, value in jax.tree_util.tree_flatten_with_path(sown)[0]:
    names = _names(path)
    if param in names:
      key = names[:len(names) - names[::-1].index(param)]
      sums[key] = value if key not in sums else sums[key] + value
  return sums


def _update(update: ParamUpdate, before, after, sown):
  """`after` with the parameters `update` names set from `before` and `sown` (its collection)."""
  sums = {} if update.rule is None else _sums(sown, update.param)
  old = {_names(path): value for path, value in jax.tree_util.tree_flatten_with_path(before)[0]
         if _names(path)[-1:] == (update.param,)}

  def replace(path, leaf):
    names = _names(path)
    if names[-1:] != (update.param,):
      return leaf
    return update.rule(old[names], sums[names]) if names in sums else old[names]
  return jax.tree_util.tree_map_with_path(replace, after)


def apply_param_updates(updates: Sequence[ParamUpdate], before, after,
                        sown: Mapping[str, object] | None):
  """`after` (the optimizer's parameters) with every parameter an update names set anew from its
  value in `before` (`ParamUpdate`); `sown`: {collection: what the model sowed}, as the objective
  returned it, which must hold the collection of every update with a rule."""
  for update in updates:
    values = (sown or {}).get(update.collection)
    if update.rule is not None and values is None:
      raise ValueError(f"parameters {update.param!r} updated from the {update.collection!r} "
                       "collection, which the objective did not return: it must apply the model "
                       "with that collection mutable and return it (runner/train/objectives.py)")
    after = _update(update, before, after, values or {})
  return after
