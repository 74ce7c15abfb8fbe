"""One way to look inside a model: the routing decisions its MoE layers sow, read back by layer.

Applied with `mutable=["intermediates"]`, every MoE layer (moe/layer.py) sows what its router
family (`RouterFamily`) decided; `routing_records` gathers them as {layer: {name: array}}, keyed
"layer_<i>" (block i) or "member_<j>/layer_<i>" (a deep ensemble's models), images first:

  expert_weights    (images, tokens, E) float32   the weight each token gives each expert
  expert_mask       (images, tokens, E) bool      the experts each token chose (or that picked it:
                                                  experts-choice); `discrete` families only
  routed_mask       (images, tokens, E) bool      the experts that process it after capacity
  selected_experts  (images, tokens, k) int32     the k chosen ids, for families that give them
                                                  (`expert_ids`; token-choice: the TOP-k)
  routed_experts    (images, tokens, k) int32     the ids kept, -1 where dropped
  <the family's>    (images, tokens, N)           `sown_records`; Soft MoE: dispatch_weights and
                                                  combine_weights, (images, tokens, E*P)

For a tiled partitioned batch ensemble the tokens axis holds the M members' copies in turn (M *
tokens), a member's weights zero outside its partition; partition_only gives (images, tokens, M*k)
ids. PGD's routing change and the routing analysis (runner/evaluators) read these."""
from __future__ import annotations

import re

import jax
from flax import traverse_util

_BLOCK = re.compile(r"block_(\d+)")
_MEMBER = re.compile(r"member_\d+")  # a model of an `Ensemble`
MOE_LAYER = "moe"  # the name of an encoder block's MoE layer (runner/models/vit.py)


def routing_records(intermediates) -> dict[str, dict[str, jax.Array]]:
  """{"layer_<i>" or "member_<j>/layer_<i>": {record name: array}} of every MoE layer: whatever
  the layer sowed, so that a router family's own records come along."""
  out: dict[str, dict[str, jax.Array]] = {}
  for path, value in traverse_util.flatten_dict(dict(intermediates)).items():
    if len(path) < 2 or path[-2] != MOE_LAYER:
      continue
    blocks = [m for m in map(_BLOCK.fullmatch, path) if m]
    if not blocks:
      raise ValueError(f"{path[-1]} sown outside an encoder block: {'/'.join(path)}")
    member = [p + "/" for p in path if _MEMBER.fullmatch(p)]
    layer = f"{''.join(member[:1])}layer_{blocks[-1][1]}"
    out.setdefault(layer, {})[path[-1]] = value[-1]  # sow keeps every call's value
  return out


def apply_with_routing(model, params, images, **kwargs):
  """(logits, extras, records): a forward pass that also returns every layer's routing records."""
  (logits, extras), state = model.apply({"params": params}, images, mutable=["intermediates"],
                                        **kwargs)
  return logits, extras, routing_records(state.get("intermediates", {}))
