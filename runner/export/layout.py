"""The Flax parameters of a vmoe model under the exported PyTorch module's names and layouts.

Every Flax parameter is mapped exactly once, by an explicit rule, or the conversion fails naming
the parameters it could not place: a converter that skips what it does not know (an MoE layer's
experts, say) would write a model that loads and runs, and is wrong. Layouts change by the
transforms below (an `nn.Linear` weight is the transpose of a Flax kernel); numpy only."""
from __future__ import annotations

import re
from typing import Callable, Mapping

import numpy as np

from runner.config import derived
from runner.config.schema import ModelConfig
from runner.export import architecture

Rule = tuple[str, Callable[[np.ndarray], np.ndarray]]  # (PyTorch name, its layout from Flax's)


class LayoutError(ValueError):
  """The parameters do not map one to one onto the exported module's."""


def flatten(params: Mapping) -> dict[str, np.ndarray]:
  """A nested parameter tree -> {"block_1/moe/experts/fc1_kernel": array} (as
  runner.models.transfer.flatten names them)."""
  flat = {}
  for key, value in params.items():
    if isinstance(value, Mapping):
      flat.update({f"{key}/{name}": v for name, v in flatten(value).items()})
    else:  # an array, or a Flax init's boxed (logically partitioned) array
      flat[str(key)] = np.asarray(value.unbox() if hasattr(value, "unbox") else value)
  return flat


def _heads_in(a):  # a (D, H, hd) kernel -> (H * hd, D); the fused (D, 3, H, hd) -> (3 * H * hd, D)
  return a.reshape(a.shape[0], -1).T


def _heads_out(a):  # an (H, hd, D) output kernel -> (D, H * hd)
  return a.reshape(-1, a.shape[-1]).T


def _conv(a):  # the (p, p, C, D) patch embedding -> an nn.Conv2d weight (D, C, p, p)
  return a.transpose(3, 2, 0, 1)


def _experts(a):  # stacked (E, in, out) kernels -> (E, out, in)
  return a.transpose(0, 2, 1)


def _linear(flax_name: str, torch_name: str) -> dict[str, Rule]:
  return {f"{flax_name}/kernel": (f"{torch_name}.weight", np.transpose),
          f"{flax_name}/bias": (f"{torch_name}.bias", np.asarray)}


def _norm(flax_name: str, torch_name: str, bias: bool = True) -> dict[str, Rule]:
  rules = {f"{flax_name}/scale": (f"{torch_name}.weight", np.asarray)}
  if bias:
    rules[f"{flax_name}/bias"] = (f"{torch_name}.bias", np.asarray)
  return rules


# Rules of the parameters inside one encoder block (the names after `block_<i>/`).
_BLOCK: dict[str, Rule] = {
    **_norm("norm1", "norm1"), **_norm("norm2", "norm2"),
    "attention/qkv_kernel": ("attention.qkv.weight", _heads_in),
    "attention/qkv_bias": ("attention.qkv.bias", np.ravel),
    "attention/out_kernel": ("attention.out.weight", _heads_out),
    "attention/out_bias": ("attention.out.bias", np.asarray),
    **_norm("attention/query_ln", "attention.query_ln", bias=False),
    **_norm("attention/key_ln", "attention.key_ln", bias=False),
    **_linear("mlp/fc1", "mlp.fc1"), **_linear("mlp/fc2", "mlp.fc2"),
    "ls1": ("ls1", np.asarray), "ls2": ("ls2", np.asarray),  # layer scale
    **{f"moe/{e}/{fc}_kernel": (f"moe.{e}.{fc}_weight", _experts)
       for e in ("experts", "shared") for fc in ("fc1", "fc2")},
    **{f"moe/{e}/{fc}_bias": (f"moe.{e}.{fc}_bias", np.asarray)
       for e in ("experts", "shared") for fc in ("fc1", "fc2")},
}

# Rules of the parameters outside the blocks.
_TOP: dict[str, Rule] = {
    "embedding_kernel": ("embedding.weight", _conv),
    "embedding_bias": ("embedding.bias", np.asarray),
    **{name: (name, np.asarray) for name in ("cls", "pos_embedding", "registers")},
    **_norm("pre_norm", "pre_norm"),
    **_norm("encoder_norm", "encoder_norm"),
    **_norm("fc_norm", "fc_norm"),
    "map_head/probe": ("map_head.probe", np.asarray),
    **{f"map_head/attention/{p}/kernel": (f"map_head.attention.{p}.weight", _heads_in)
       for p in ("query", "key", "value")},
    **{f"map_head/attention/{p}/bias": (f"map_head.attention.{p}.bias", np.ravel)
       for p in ("query", "key", "value")},
    "map_head/attention/out/kernel": ("map_head.attention.out.weight", _heads_out),
    "map_head/attention/out/bias": ("map_head.attention.out.bias", np.asarray),
    **_norm("map_head/attention/query_ln", "map_head.attention.query_ln", bias=False),
    **_norm("map_head/attention/key_ln", "map_head.attention.key_ln", bias=False),
    **_norm("map_head/norm", "map_head.norm"),
    **_linear("map_head/mlp/fc1", "map_head.mlp.fc1"),
    **_linear("map_head/mlp/fc2", "map_head.mlp.fc2"),
    **_linear("pre_logits", "pre_logits"),
    **_linear("head", "head"),  # a linear head
    **{k: v for layer in ("loc_layer", "diag_layer", "scale_layer", "scale_layer_homoscedastic",
                          "scale_layer_heteroscedastic")
       for k, v in _linear(f"head/{layer}", f"head.{layer}").items()},  # a heteroscedastic head
    "head/pre_sigmoid_temperature": ("head.pre_sigmoid_temperature", np.asarray),
}

_IN_BLOCK = re.compile(r"block_(\d+)/(.+)")
_ROUTER = "moe/router/"


def _router_rules(model: ModelConfig) -> dict[str, Rule]:
  """The router family's parameters (under a block's `moe/router/`)."""
  routing = architecture.torch_routing(model) if derived.num_experts(model) else None
  if routing is None:
    return {}
  return {_ROUTER + flax_name: (f"moe.router.{torch_name}", np.asarray if axes is None
                                else (lambda a, axes=tuple(axes): a.transpose(axes)))
          for flax_name, (torch_name, axes) in routing.parameters.items()}


def torch_state_dict(params: Mapping, model: ModelConfig) -> dict[str, np.ndarray]:
  """{PyTorch parameter name: float32 C-contiguous array} for the Flax parameter tree `params` of
  `model`; LayoutError names every parameter no rule places, or two that would land on one name."""
  block_rules = {**_BLOCK, **_router_rules(model)}
  out: dict[str, np.ndarray] = {}
  source: dict[str, str] = {}
  unmapped, twice = [], []
  for name, value in flatten(params).items():
    match = _IN_BLOCK.fullmatch(name)
    rule = block_rules.get(match[2]) if match else _TOP.get(name)
    if rule is None:
      unmapped.append(name)
      continue
    target, transform = rule
    if match:
      target = f"blocks.{int(match[1])}.{target}"
    if target in out:
      twice.append(f"{source[target]} and {name} -> {target}")
      continue
    out[target] = np.ascontiguousarray(transform(np.asarray(value)), dtype=np.float32)
    source[target] = name
  problems = []
  if unmapped:
    hint = (" (router parameters are placed by the family's TorchRouting.parameters)"
            if any(f"/{_ROUTER}" in n for n in unmapped) else "")
    problems.append(f"no place in the PyTorch module for {len(unmapped)} Flax parameter(s): "
                    f"{', '.join(unmapped)}{hint}")
  if twice:
    problems.append(f"Flax parameters mapped onto the same PyTorch name: {'; '.join(twice)}")
  if problems:
    raise LayoutError("cannot export these parameters: " + ". ".join(problems) + ".")
  return out
