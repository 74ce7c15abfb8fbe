"""A vmoe Vision Transformer / Vision MoE in PyTorch, written by `vmoe export`.

    import importlib.util
    spec = importlib.util.spec_from_file_location("modeling_vmoe", "<folder>/modeling_vmoe.py")
    modeling = importlib.util.module_from_spec(spec); spec.loader.exec_module(modeling)
    model = modeling.load("<folder>")           # eval mode, weights from model.safetensors
    probs = model.predict_proba(images)          # (B, C, H, W) float32, any B -> (B, classes)

`images` are already mapped as config.json's `preprocessing` says. The folder holds this file,
config.json (the architecture and the inference settings) and model.safetensors (the weights,
under this module's parameter names). Only torch, safetensors and the standard library are used.

It computes the vmoe (Flax) model at inference (`train=False`), to 1e-4 on float32 probabilities
(no dropout, no routing noise, the routers' inference capacity), making vmoe's choices:
- LayerNorm with config.json's `layer_norm_eps`, 1e-6 (Flax's default, not PyTorch's 1e-5)
  unless the model says otherwise (1e-12: a transformers ViT's), the qk-norms' `qk_norm_eps`;
- GELU with the tanh approximation (Flax's `nn.gelu` default), or config.json's `activation`:
  "gelu" (exact) or "quick_gelu" (OpenAI CLIP's), in the MLPs and the experts;
- the variants of timm's and transformers' ViTs, where config.json names them: `registers`
  (learned tokens after the class token, left out of pooling), `layer_scale` (per-channel scales
  `ls1`, `ls2` of each block's attention and MLP outputs), `pre_norm` (a LayerNorm before the
  blocks), `fc_norm` (the final LayerNorm after average pooling instead of before);
- attention and routing computed in float32;
- a mixture-of-experts layer routes *groups* of images together: the tokens of `group_size`
  consecutive images compete for the same expert slots, so a prediction can depend on the other
  images of its group. Any batch size works: a batch smaller than a group is one group, as vmoe
  routes it; a short last group is completed with zero images, as `vmoe eval` pads its last
  batch, and their rows dropped from the output;
- DeepSeekMoE's experts: `moe.expert_mlp_dim` is the width of fine-grained experts (narrower
  than `mlp_dim`); `moe.shared_experts` K_s experts of that width process every token, their
  outputs added to the routed output;
- a partitioned batch ensemble returns its members' mean probability (as logits);
- a heteroscedastic head (HET, HET-XL) returns the log of a Monte-Carlo mean probability, its
  draws from `torch.Generator().manual_seed(seed)` (JAX's cannot be reproduced in PyTorch): it
  matches vmoe in distribution (up to Monte-Carlo error, ~1/sqrt(mc_samples)), not draw for draw."""
from __future__ import annotations

import fractions
import json
import math
import pathlib

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

MIN_SCALE = 1e-3  # added to the softplus of a heteroscedastic head's rank-1 noise scale


def gelu(x: torch.Tensor) -> torch.Tensor:
  return F.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
  return x * torch.sigmoid(1.702 * x)


# config.json's `activation` (absent: gelu_tanh, Flax's nn.gelu).
ACTIVATIONS = {"gelu_tanh": gelu, "gelu": F.gelu, "quick_gelu": quick_gelu}


# ---- routing: what routers share ----------------------------------------------------------------
# A router family is a class `Router(config: dict, dim: int, num_experts: int)`, an nn.Module
# whose parameters carry the names of model.safetensors (config: the router's entries of
# config.json). `plan = router(x, first, count)` routes the tokens x (G, S, D) of G routing
# groups among the experts [first, first + count), with those experts' router columns only (a
# partitioned batch ensemble routes each member among its own partition). The plan has
#   plan.dispatch(x) -> (count, G, C, D): the experts' input buffers (C slots per group), and
#   plan.combine(y)  -> (G, S, D): the tokens' outputs from the experts' outputs y (count, G, C, D).
# This model's router family is appended below "router families", in ROUTERS under its name
# (config.json's moe.router.type).


def expert_capacity(num_tokens: int, num_experts: int, k: int, ratio: float,
                    rounding: str = "paper") -> int:
  """Slots per expert for a group of `num_tokens` tokens that each go to k of `num_experts`.

  "paper": round(k * N * ratio / E), half up, at least 1 (V-MoE, section 2.4), computed exactly
  from the ratio's decimal digits (0.7 * 45 / 3 is 10.5, not 10.4999...). "reference": as the
  google-research/vmoe code, ceil(((N * k) * ratio) / E) in floats, up to a multiple of 4."""
  if rounding == "reference":
    capacity = max(1, math.ceil(num_tokens * k * float(ratio) / num_experts))
    return capacity + (-capacity) % 4
  if rounding != "paper":
    raise ValueError(f"unknown capacity rounding {rounding!r}; valid: paper, reference")
  exact = fractions.Fraction(str(ratio)) * k * num_tokens / num_experts
  return max(1, math.floor(exact + fractions.Fraction(1, 2)))


def top_k(values: torch.Tensor, k: int) -> torch.Tensor:
  """Indices of the k largest values along the last axis, largest first, ties to the lower index
  as in vmoe (a stable sort: `torch.topk` does not say which of two equal values comes first)."""
  return torch.sort(values.detach(), dim=-1, descending=True, stable=True).indices[..., :k]


class SlotPlan:
  """A routing that fills expert slots with single tokens (token choice, experts choice).

  token_of_slot (G, E, C) long: each slot's token (an index into the group's S tokens; S when
  empty); weight_of_slot (G, E, C): the weight of the slot's output in its token's output (0 when
  empty). A token's output is the weighted sum of its slots' outputs."""

  def __init__(self, token_of_slot: torch.Tensor, weight_of_slot: torch.Tensor, num_tokens: int):
    self.token_of_slot, self.weight_of_slot, self.num_tokens = (token_of_slot, weight_of_slot,
                                                                num_tokens)

  def _index(self, dim: int) -> torch.Tensor:
    g, e, c = self.token_of_slot.shape
    return self.token_of_slot.reshape(g, e * c, 1).expand(g, e * c, dim)

  def dispatch(self, x: torch.Tensor) -> torch.Tensor:
    """(G, S, D) tokens -> (E, G, C, D) buffers; empty slots hold zeros."""
    g, _, d = x.shape
    _, e, c = self.token_of_slot.shape
    padded = torch.cat([x, x.new_zeros(g, 1, d)], dim=1)  # row S: what an empty slot reads
    return padded.gather(1, self._index(d)).reshape(g, e, c, d).transpose(0, 1)

  def combine(self, y: torch.Tensor) -> torch.Tensor:
    """(E, G, C, D) outputs -> (G, S, D): each token sums its slots' weighted outputs."""
    e, g, c, d = y.shape
    weighted = y.transpose(0, 1).reshape(g, e * c, d) * self.weight_of_slot.reshape(g, e * c, 1)
    out = y.new_zeros(g, self.num_tokens + 1, d).scatter_add(1, self._index(d), weighted)
    return out[:, :-1]  # row S collected the empty slots


def plan_top_k(gates: torch.Tensor, k: int, capacity: int, batch_priority: bool = False,
               priority: str = "max", select: torch.Tensor | None = None) -> SlotPlan:
  """V-MoE's assignment of tokens to expert slots, for gates (G, S, E) (softmax outputs).

  Each token goes to its TOP-k experts. Every token's first choice is placed before any second
  choice, and so on; within one rank tokens come in their order in the group (Algorithm 1), or
  with Batch Prioritized Routing by decreasing max gate (`priority` "max") or sum of their k
  gates ("sum"), ties in token order (Algorithm 2). An assignment that finds its expert's
  `capacity` slots full is dropped. The combine weight is the gate itself (not renormalised).
  `select` (G, S, E), when given, chooses the TOP-k in place of the gates (a bias-balanced
  router's scores plus its bias); the gates still weigh the chosen experts."""
  g, s, e = gates.shape
  experts = top_k(gates if select is None else select, k)  # (G, S, k)
  weights = gates.gather(-1, experts)
  if batch_priority:
    score = weights[..., 0] if priority == "max" else weights.sum(-1)
    rank = torch.argsort(torch.argsort(-score.detach(), dim=-1, stable=True), dim=-1)
  else:
    rank = torch.arange(s, device=gates.device).expand(g, s)
  # Assignment a = token * k + choice; its priority choice * S + rank is unique in the group.
  choice = torch.arange(k, device=gates.device) * s
  order = torch.argsort((rank[..., None] + choice).reshape(g, s * k), dim=-1)
  expert_in_order = experts.reshape(g, s * k).gather(1, order)
  onehot = F.one_hot(expert_in_order, e)
  position_in_order = (onehot.cumsum(1) * onehot).sum(-1) - 1  # earlier assignments to the expert
  position = torch.empty_like(position_in_order).scatter(1, order, position_in_order)
  kept = position < capacity
  spare = e * capacity  # one slot past the end receives what was dropped, then is cut off
  slot = torch.where(kept, experts.reshape(g, s * k) * capacity + position, spare)
  token = torch.arange(s, device=gates.device).repeat_interleave(k).expand(g, s * k)
  token_of_slot = torch.full((g, spare + 1), s, device=gates.device).scatter(1, slot, token)
  weight_of_slot = gates.new_zeros(g, spare + 1).scatter(1, slot, weights.reshape(g, s * k))
  return SlotPlan(token_of_slot[:, :-1].reshape(g, e, capacity),
                  weight_of_slot[:, :-1].reshape(g, e, capacity), s)


ROUTERS: dict[str, type] = {}  # family name -> router class, filled by the families below

# ---- router families (added by vmoe export) ----


# ---- the model ----------------------------------------------------------------------------------

class Mlp(nn.Module):
  def __init__(self, dim: int, mlp_dim: int, activation: str = "gelu_tanh"):
    super().__init__()
    self.fc1, self.fc2 = nn.Linear(dim, mlp_dim), nn.Linear(mlp_dim, dim)
    self.activation = ACTIVATIONS[activation]

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.fc2(self.activation(self.fc1(x)))


def qk_layer_norm(head_dim: int, eps: float) -> nn.LayerNorm:
  """qk-norm (Dehghani et al. 2023): a LayerNorm over one head's dimensions, a scale and no bias."""
  return nn.LayerNorm(head_dim, eps=eps, bias=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
  """Attention of (B, Sq, H, hd) queries on (B, Sk, H, hd) keys and values, softmax in float32."""
  logits = torch.einsum("bqhd,bkhd->bhqk", q * q.shape[-1] ** -0.5, k)
  weights = torch.softmax(logits.float(), dim=-1).to(v.dtype)
  return torch.einsum("bhqk,bkhd->bqhd", weights, v)


class SelfAttention(nn.Module):
  """Multi-head self-attention with one fused query-key-value projection, and optional qk-norm."""

  def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float):
    super().__init__()
    self.num_heads = num_heads
    self.qkv = nn.Linear(dim, 3 * dim)  # output features ordered (q|k|v, head, head dim)
    self.out = nn.Linear(dim, dim)
    self.query_ln = qk_layer_norm(dim // num_heads, eps) if qk_norm else None
    self.key_ln = qk_layer_norm(dim // num_heads, eps) if qk_norm else None

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, n, d = x.shape
    q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, d // self.num_heads).unbind(2)
    if self.query_ln is not None:
      q, k = self.query_ln(q), self.key_ln(k)
    return self.out(attend(q, k, v).reshape(b, n, d))


class Experts(nn.Module):
  """E two-layer GELU MLPs, one per expert, as stacked (E, out, in) weights."""

  def __init__(self, num_experts: int, dim: int, mlp_dim: int, activation: str = "gelu_tanh"):
    super().__init__()
    self.activation = ACTIVATIONS[activation]
    self.fc1_weight = nn.Parameter(torch.zeros(num_experts, mlp_dim, dim))
    self.fc1_bias = nn.Parameter(torch.zeros(num_experts, mlp_dim))
    self.fc2_weight = nn.Parameter(torch.zeros(num_experts, dim, mlp_dim))
    self.fc2_bias = nn.Parameter(torch.zeros(num_experts, dim))

  def forward(self, buffers: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """(count, G, C, D) buffers of experts [first, first + count) -> their outputs."""
    span = slice(first, first + count)
    h = torch.einsum("egcd,ehd->egch", buffers, self.fc1_weight[span])
    h = self.activation(h + self.fc1_bias[span][:, None, None])
    y = torch.einsum("egch,edh->egcd", h, self.fc2_weight[span])
    return y + self.fc2_bias[span][:, None, None]


class MoeMlp(nn.Module):
  """A sparse mixture-of-experts MLP (V-MoE): route, dispatch, run the experts, combine.

  The tokens of `group_size` consecutive images (of fewer, when the batch is smaller) form one
  routing group; a group's tokens are concatenated image by image. The batch must fill whole
  groups: `VisionTransformer.representation` pads it so with zero images. A partitioned batch
  ensemble of M members (`ensemble_size`) splits the E experts into M partitions of E/M:
  - "pbe": each image's row is repeated M times (row b*M + m is member m's copy of image b,
    done by the model before its first MoE layer); member m's copies in a group are routed
    among partition m's experts by partition m's router columns;
  - "tiling_only": repeated rows, one routing over all E experts;
  - "partition_only": rows are not repeated; every group is routed in each partition and the
    partitions' outputs are summed."""

  def __init__(self, moe: dict, dim: int, mlp_dim: int, activation: str = "gelu_tanh"):
    super().__init__()
    self.num_experts, self.group_size = moe["num_experts"], moe["group_size"]
    self.members, self.variant = moe["ensemble_size"], moe["ensemble_variant"]
    # DeepSeekMoE: narrower fine-grained experts; shared ones of that width take every token.
    mlp_dim = moe.get("expert_mlp_dim", mlp_dim)
    self.experts = Experts(self.num_experts, dim, mlp_dim, activation)
    shared = moe.get("shared_experts", 0)
    self.shared = Experts(shared, dim, mlp_dim, activation) if shared else None
    router = moe["router"]
    if router["type"] not in ROUTERS:
      raise ValueError(f"router type {router['type']!r} is not defined in this file")
    self.router = ROUTERS[router["type"]](router, dim, self.num_experts)

  def route(self, x: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """(G, S, D) groups routed among experts [first, first + count) -> (G, S, D)."""
    plan = self.router(x, first, count)
    return plan.combine(self.experts(plan.dispatch(x), first, count))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = self.routed(x)
    if self.shared is None:
      return y
    count = self.shared.fc1_weight.shape[0]  # every shared expert takes every token
    every = x.reshape(1, 1, -1, x.shape[-1]).expand(count, -1, -1, -1)
    return y + self.shared(every, 0, count).sum(0).reshape(x.shape)

  def routed(self, x: torch.Tensor) -> torch.Tensor:
    rows, tokens, dim = x.shape
    m = self.members
    tiled = m > 1 and self.variant in ("pbe", "tiling_only")
    images = rows // m if tiled else rows
    group = min(self.group_size, images)
    if images % group or (tiled and rows % m):
      raise ValueError(f"{images} images do not fill routing groups of {group} images: pad the "
                       f"batch with zero images to a multiple of {group}, as "
                       "VisionTransformer.representation does")
    groups = images // group
    if m == 1 or self.variant == "tiling_only":
      return self.route(x.reshape(groups, -1, dim), 0, self.num_experts).reshape(x.shape)
    per_member = self.num_experts // m
    if self.variant == "pbe":
      copies = x.reshape(groups, group, m, tokens, dim)
      y = torch.stack([
          self.route(copies[:, :, i].reshape(groups, group * tokens, dim), i * per_member,
                     per_member) for i in range(m)], dim=1)  # (G, M, images * T, D)
      return y.reshape(groups, m, group, tokens, dim).transpose(1, 2).reshape(x.shape)
    if self.variant == "partition_only":
      blocks = x.reshape(groups, group * tokens, dim)
      y = sum(self.route(blocks, i * per_member, per_member) for i in range(m))
      return y.reshape(x.shape)
    raise ValueError(f"unknown ensemble variant {self.variant!r}")


class EncoderBlock(nn.Module):
  """Pre-LayerNorm transformer block; its MLP is dense or a mixture of experts; with layer scale,
  the attention's and the MLP's outputs are multiplied by per-channel factors `ls1`, `ls2`."""

  def __init__(self, config: dict, moe: dict | None):
    super().__init__()
    d, eps = config["hidden_size"], config["layer_norm_eps"]
    activation = config.get("activation", "gelu_tanh")
    self.norm1 = nn.LayerNorm(d, eps=eps)
    self.attention = SelfAttention(d, config["num_heads"], config["attention_qk_norm"],
                                   config.get("qk_norm_eps", eps))
    self.norm2 = nn.LayerNorm(d, eps=eps)
    self.mlp = Mlp(d, config["mlp_dim"], activation) if moe is None else None
    self.moe = MoeMlp(moe, d, config["mlp_dim"], activation) if moe is not None else None
    scaled = config.get("layer_scale", False)
    self.ls1 = nn.Parameter(torch.ones(d)) if scaled else None
    self.ls2 = nn.Parameter(torch.ones(d)) if scaled else None

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = self.attention(self.norm1(x))
    x = x + (y if self.ls1 is None else y * self.ls1)
    y = self.norm2(x)
    y = self.mlp(y) if self.mlp is not None else self.moe(y)
    return x + (y if self.ls2 is None else y * self.ls2)


class ProbeAttention(nn.Module):
  """Flax's MultiHeadDotProductAttention: separate query, key, value and output projections."""

  def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float):
    super().__init__()
    self.num_heads = num_heads
    self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
    self.out = nn.Linear(dim, dim)
    self.query_ln = qk_layer_norm(dim // num_heads, eps) if qk_norm else None
    self.key_ln = qk_layer_norm(dim // num_heads, eps) if qk_norm else None

  def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    def heads(t):  # (B, S, D) -> (B, S, H, hd)
      return t.reshape(t.shape[0], t.shape[1], self.num_heads, -1)

    q, k, v = heads(self.query(q)), heads(self.key(kv)), heads(self.value(kv))
    if self.query_ln is not None:
      q, k = self.query_ln(q), self.key_ln(k)
    out = attend(q, k, v)
    return self.out(out.reshape(out.shape[0], out.shape[1], -1))


class MapHead(nn.Module):
  """Multihead attention pooling: a learned probe attends to the tokens, then an MLP block."""

  def __init__(self, dim: int, num_heads: int, mlp_dim: int, qk_norm: bool, eps: float,
               activation: str = "gelu_tanh", qk_eps: float | None = None):
    super().__init__()
    self.probe = nn.Parameter(torch.zeros(1, 1, dim))
    self.attention = ProbeAttention(dim, num_heads, qk_norm, eps if qk_eps is None else qk_eps)
    self.norm = nn.LayerNorm(dim, eps=eps)
    self.mlp = Mlp(dim, mlp_dim, activation)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = self.attention(self.probe.expand(x.shape[0], -1, -1), x)
    return (y + self.mlp(self.norm(y)))[:, 0]


class HeteroscedasticHead(nn.Module):
  """HET (noise on the logits) or HET-XL (`latent`: noise on the representation, sent through
  the classifier): p(y|x) = E[sigma((mu(x) + eps(x)) / tau)], eps ~ N(0, V Vᵀ + d dᵀ) with a
  low-rank V (`num_factors` R; parameter-efficient: V = J ∘ (1 vᵀ)) and a rank-1 d, estimated
  from `mc_samples` draws of `torch.Generator().manual_seed(seed)` (it agrees with vmoe's within
  Monte-Carlo error, not draw for draw). Returns log p̄ (softmax), or logit(p̄) (sigmoid)."""

  def __init__(self, width: int, num_classes: int, head: dict, output: str):
    super().__init__()
    self.latent, self.output = head["type"] == "het_xl", output
    self.parameter_efficient = head["parameter_efficient"]
    self.num_factors, self.mc_samples = head["num_factors"], head["mc_samples"]
    self.chunk_size = head["mc_chunk_size"] or head["mc_samples"]
    self.share_samples = head["share_samples_across_batch"]
    self.temperature, self.temperature_bounds = head["temperature"], head["temperature_bounds"]
    q = width if self.latent else num_classes  # where the noise lives
    self.loc_layer = nn.Linear(width, num_classes)
    self.diag_layer = nn.Linear(width, q)
    if self.parameter_efficient:
      self.scale_layer_homoscedastic = nn.Linear(self.num_factors, q)
      self.scale_layer_heteroscedastic = nn.Linear(width, q)
    else:
      self.scale_layer = nn.Linear(width, q * self.num_factors)
    if self.temperature is None:  # learned: tau = low + (high - low) * sigmoid(t)
      self.pre_sigmoid_temperature = nn.Parameter(torch.zeros(1))

  def tau(self) -> torch.Tensor | float:
    if self.temperature is not None:
      return float(self.temperature)
    low, high = self.temperature_bounds
    return low + (high - low) * torch.sigmoid(self.pre_sigmoid_temperature[0])

  def noise(self, x: torch.Tensor, z: torch.Tensor, zeta: torch.Tensor) -> torch.Tensor:
    """eps (B, c, Q) for standard-normal draws z (B or 1, c, R) and zeta (B or 1, c, 1)."""
    d = F.softplus(self.diag_layer(x)) + MIN_SCALE
    if self.parameter_efficient:
      low_rank = self.scale_layer_homoscedastic(z) * self.scale_layer_heteroscedastic(x)[:, None]
    else:
      v = self.scale_layer(x).reshape(x.shape[0], d.shape[-1], self.num_factors)
      low_rank = torch.einsum("bqr,bsr->bsq", v, z.expand(x.shape[0], -1, -1))
    return low_rank + d[:, None, :] * zeta

  def sample_logits(self, x: torch.Tensor, z: torch.Tensor, zeta: torch.Tensor) -> torch.Tensor:
    """(B, c, K) logits of c samples, divided by the temperature."""
    eps = self.noise(x, z, zeta)
    if self.latent:
      logits = self.loc_layer(x[:, None, :] + eps)
    else:
      logits = self.loc_layer(x)[:, None, :] + eps
    return logits / self.tau()

  def mean_logits(self, x: torch.Tensor, draws) -> torch.Tensor:
    """Logits of the mean probability over the samples of `draws`, an iterable of (z, zeta)
    chunks; computed in log space (a running logsumexp), so no probability is clipped."""
    log_sums, count = None, 0  # log of the summed probabilities: p (softmax), or p and 1 - p
    for z, zeta in draws:
      logits = self.sample_logits(x, z, zeta)
      count += z.shape[1]
      if self.output == "softmax":
        terms = torch.logsumexp(F.log_softmax(logits, dim=-1), dim=1)[None]
      else:
        terms = torch.stack([torch.logsumexp(F.logsigmoid(logits), dim=1),
                             torch.logsumexp(F.logsigmoid(-logits), dim=1)])
      log_sums = terms if log_sums is None else torch.logaddexp(log_sums, terms)
    if self.output == "softmax":
      return log_sums[0] - math.log(count)
    return log_sums[0] - log_sums[1]  # logit(p̄) = log p̄ - log(1 - p̄); the 1/count cancels

  def forward(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device=x.device).manual_seed(seed)
    rows = 1 if self.share_samples else x.shape[0]

    def draws():  # `mc_chunk_size` samples at a time: memory grows with the chunk, not the samples
      for start in range(0, self.mc_samples, self.chunk_size):
        c = min(self.chunk_size, self.mc_samples - start)
        z = torch.randn(rows, c, self.num_factors, generator=generator, device=x.device)
        zeta = torch.randn(rows, c, 1, generator=generator, device=x.device)
        yield z, zeta

    return self.mean_logits(x, draws())


def combine_logits(member_logits: torch.Tensor, output: str) -> torch.Tensor:
  """(B, M, K) members' logits -> (B, K) logits of their mean probability p̄: log p̄ for a
  softmax, logit(p̄) for sigmoids (members average probabilities, never logits)."""
  log_m = math.log(member_logits.shape[1])
  if output == "softmax":
    return torch.logsumexp(F.log_softmax(member_logits, dim=-1), dim=1) - log_m
  log_p = torch.logsumexp(F.logsigmoid(member_logits), dim=1) - log_m
  log_not_p = torch.logsumexp(F.logsigmoid(-member_logits), dim=1) - log_m
  return log_p - log_not_p


class VisionTransformer(nn.Module):
  """ViT / V-MoE classifier built from config.json; `forward(images)` returns logits."""

  def __init__(self, config: dict):
    super().__init__()
    self.config = config
    d, p = config["hidden_size"], config["patch_size"]
    self.classifier, self.output = config["classifier"], config["output"]
    self.embedding = nn.Conv2d(config["num_channels"], d, p, stride=p)  # patches, projected
    if self.classifier == "token":
      self.cls = nn.Parameter(torch.zeros(1, 1, d))
    self.num_registers = config.get("registers", 0)
    if self.num_registers:  # after the class token, before the patches
      self.registers = nn.Parameter(torch.zeros(1, self.num_registers, d))
    self.pos_embedding = nn.Parameter(torch.zeros(1, (config["image_size"] // p) ** 2, d))
    eps = config["layer_norm_eps"]
    self.pre_norm = nn.LayerNorm(d, eps=eps) if config.get("pre_norm") else None
    moe = config.get("moe")
    moe_layers = set(moe["layers"]) if moe else set()
    self.blocks = nn.ModuleList(EncoderBlock(config, moe if i in moe_layers else None)
                                for i in range(config["num_layers"]))
    # A tiled ensemble (pbe, tiling_only) repeats each image's row M times before its first
    # MoE block; everything before runs once.
    tiled = moe and moe["ensemble_size"] > 1 and moe["ensemble_variant"] != "partition_only"
    self.tiles = moe["ensemble_size"] if tiled else 1
    self.first_moe = min(moe_layers) if moe_layers else None
    self.group_size = moe["group_size"] if moe_layers else None
    # The final LayerNorm: on every token, or (fc_norm, average pooling) on their mean.
    self.fc_norm = nn.LayerNorm(d, eps=eps) if config.get("fc_norm") else None
    self.encoder_norm = nn.LayerNorm(d, eps=eps) if self.fc_norm is None else None
    if self.classifier == "map":
      self.map_head = MapHead(d, config["num_heads"], config["mlp_dim"],
                              config["attention_qk_norm"], eps,
                              config.get("activation", "gelu_tanh"), config.get("qk_norm_eps"))
    width = config.get("representation_size") or d
    self.pre_logits = nn.Linear(d, width) if config.get("representation_size") else None
    head = config["head"]
    self.head = (nn.Linear(width, config["num_classes"]) if head["type"] == "det"
                 else HeteroscedasticHead(width, config["num_classes"], head, self.output))

  def padded_to_whole_groups(self, images: torch.Tensor) -> torch.Tensor:
    """`images` and the zero images that complete a short last routing group (routing depends on
    every token of a group), as `vmoe eval` pads its last batch; a batch smaller than a group
    stays one group, as vmoe routes it."""
    count, group = images.shape[0], self.group_size
    if group is None or count <= group or count % group == 0:
      return images
    return torch.cat([images, images.new_zeros(group - count % group, *images.shape[1:])])

  def representation(self, images: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) images, any B -> (B * M, width): what the classifier reads, one row per image
    (per member of a tiled ensemble, image-major: row b * M + m)."""
    size, channels = self.config["image_size"], self.config["num_channels"]
    if images.ndim != 4 or tuple(images.shape[1:]) != (channels, size, size):
      raise ValueError(f"images must be (batch, {channels}, {size}, {size}); got "
                       f"{tuple(images.shape)}")
    rows = images.shape[0] * self.tiles  # the padding's rows come after them, and are dropped
    images = self.padded_to_whole_groups(images)
    x = self.embedding(images).flatten(2).transpose(1, 2)  # (B, patches, D), row-major patches
    x = x + self.pos_embedding
    if self.num_registers:  # nor do the registers
      x = torch.cat([self.registers.expand(x.shape[0], -1, -1), x], dim=1)
    if self.classifier == "token":  # the class token has no position embedding
      x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
    if self.pre_norm is not None:
      x = self.pre_norm(x)
    for i, block in enumerate(self.blocks):
      if self.tiles > 1 and i == self.first_moe:
        x = x.repeat_interleave(self.tiles, dim=0)
      x = block(x)
    x = x[:rows]
    if self.encoder_norm is not None:
      x = self.encoder_norm(x)
    if self.classifier != "token":  # pooling leaves the registers out
      x = x[:, self.num_registers:]
    if self.classifier == "token":
      x = x[:, 0]
    elif self.classifier == "gap":
      x = x.mean(dim=1)
    elif self.classifier == "map":
      x = self.map_head(x)
    else:
      raise ValueError(f"unknown classifier {self.classifier!r}")
    if self.fc_norm is not None:
      x = self.fc_norm(x)
    if self.pre_logits is not None:
      x = torch.tanh(self.pre_logits(x))
    return x

  def forward(self, images: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """(B, C, H, W) float32 images, any B -> (B, classes) logits, as vmoe's at inference.
    `seed`: the Monte-Carlo draws of a heteroscedastic head (unused otherwise)."""
    x = self.representation(images)
    logits = self.head(x, seed=seed) if isinstance(self.head, HeteroscedasticHead) else self.head(x)
    if self.tiles > 1:
      logits = combine_logits(logits.reshape(images.shape[0], self.tiles, -1), self.output)
    return logits

  def predict_proba(self, images: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Class probabilities: softmax of the logits (sigmoids for a multi-label model)."""
    logits = self.forward(images, seed=seed)
    return torch.sigmoid(logits) if self.output == "sigmoid" else torch.softmax(logits, dim=-1)


def load(directory) -> VisionTransformer:
  """The model of an export folder in eval mode, on the CPU (`.to(device)` moves it), from
  config.json and model.safetensors (each tensor must match a parameter, and the reverse)."""
  directory = pathlib.Path(directory)
  config = json.loads((directory / "config.json").read_text())
  model = VisionTransformer(config)
  model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=True)
  return model.eval()
