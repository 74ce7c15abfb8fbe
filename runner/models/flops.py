"""Analytic model FLOPs: the matmul FLOPs of a forward pass, counted from the architecture.

Conventions (V-MoE / MFU): a (m x k) @ (k x n) matmul costs 2*m*k*n FLOPs; an MoE layer costs
what its router family answers (`RouterFamily.expert_rows`, `router_flops`: every buffer slot at
padded capacity, filled or not; dropless: k expert MLPs per token; DeepSeekMoE: docs/routers.md);
dispatch bookkeeping, softmax, normalisation and activations are not counted. A training step
costs three forward passes (two matmuls per matmul in the backward pass).

Partitioned batch ensembles (E³, `model.moe.ensemble_size` M > 1; the efficient-ensembles paper,
Section 4 and Appendix D; Table 11 its FLOPs): a routing group is routed as one or several
blocks, each costed by the family as a group of its own (token-choice: capacity
expert_capacity(tokens, experts, k, C), router 2·tokens·D·experts):
  pbe             the representation is repeated M times right before the first MoE block, so
                  that block, every later one, the pre-logits and the head run on M rows per image; each replica routes among its
                  member's E/M experts with its router columns: M blocks of group_size·T tokens
                  and E/M experts per routing group (router: M·D·E/M = D·E per token).
  tiling_only     repeated as pbe, but one router over all E experts on every replica: one block
                  of group_size·M·T rows and E experts (router: M·D·E per token); for a family
                  that forms no ensembles (the copies are MC-dropout's samples, each its own
                  pass), M blocks of group_size·T tokens and E experts.
  partition_only  no repetition; each token is routed in every partition with the member routers:
                  M blocks of group_size·T tokens and E/M experts (router: D·E per token).
In every case an MoE layer computes E·capacity/group_size expert slots per image; M = 1 is a
V-MoE (one block of group_size·T tokens, E experts), and a ViT ignores M.

Heteroscedastic heads (HET-XL paper, Table 11; S training or evaluation MC samples, R factors, D
the pre-logits' width, K classes, Q = K for HET and D for HET-XL): the mean classifier 2·D·K; the
rank-1 scale 2·D·Q; the low-rank scale 2·D·Q (parameter-efficient v(x)) plus 2·S·R·Q for the
draws through J, or 2·D·Q·R plus 2·S·R·Q (full); HET-XL's samples through the classifier 2·S·D·K."""
from __future__ import annotations

from runner.config import derived
from runner.config.derived import moe_layer_indices
from runner.config.schema import Classifier, EnsembleVariant, HeadType, ModelConfig
from runner.models.moe import routers


def forward_flops_per_image(config: ModelConfig, num_classes: int, *, batch_size: int,
                            train: bool = True) -> float:
  """Forward matmul FLOPs per input image of a model config (the `model.` keys) at `batch_size`;
  with a tiled ensemble (pbe, tiling_only) the M replicas of an image are all part of its cost."""
  d, m, layers, p = config.hidden_size, config.mlp_dim, config.num_layers, config.patch_size
  patches = (config.image_size // p) ** 2
  tokens = derived.tokens_per_image(config)  # the class token's and the registers' included
  flops = 2.0 * patches * (p * p * 3) * d  # patch embedding
  attention = 2.0 * tokens * d * 3 * d + 2 * 2.0 * tokens * tokens * d + 2.0 * tokens * d * d
  dense_mlp = 2 * 2.0 * tokens * d * m
  moe = config.moe
  moe_layers = moe_layer_indices(moe.layers or [], layers) if moe.num_experts else ()
  # Fine-grained experts (DeepSeekMoE): E*m experts of width mlp_dim/m, routed k*m at a time.
  e = derived.num_experts(config) if moe_layers else moe.num_experts
  router = derived.router(config) if moe_layers else config.router
  expert_width = derived.expert_width(config)
  shared_mlp = 2 * 2.0 * tokens * d * expert_width * derived.shared_experts(config)
  members = moe.ensemble_size if moe_layers else 1  # a dense ViT has nothing to partition
  variant = EnsembleVariant(moe.ensemble_variant)  # tiling_only needs no partition of the experts
  if members > 1 and variant != EnsembleVariant.tiling_only and e % members:
    raise ValueError(f"model.moe.num_experts={e} is not divisible by "
                     f"model.moe.ensemble_size={members}")
  tiled = members > 1 and variant in (EnsembleVariant.pbe, EnsembleVariant.tiling_only)
  family = routers.family(router.type) if moe_layers else None
  # Per routing group: `blocks` routings of `replicas` rows per image among `experts` experts.
  if members > 1 and variant == EnsembleVariant.tiling_only:
    # One router over the copies, unless they are MC-dropout's samples (no ensembles): one by one.
    blocks, replicas = (1, members) if family.supports_ensembles else (members, 1)
    experts = e
  elif members > 1:  # pbe (a member's replicas), partition_only (every token, each partition)
    blocks, replicas, experts = members, 1, e // members
  else:
    blocks, replicas, experts = 1, 1, e
  first_tiled = min(moe_layers) if tiled else layers
  rows = 1  # rows per image: M from the first MoE block on when tiled
  for i in range(layers):
    if i == first_tiled:
      rows = members
    flops += rows * attention
    if i not in moe_layers:
      flops += rows * dense_mlp
      continue
    group = min(moe.group_size, batch_size)  # images per routing group (per member when tiled)
    # Slots that are parameters (Soft MoE) follow the configured group, not the batch.
    block_tokens = (group if family.capacity_at_inference else moe.group_size) * replicas * tokens
    capacity = family.capacity(router, block_tokens, experts, train=train)
    flops += blocks * family.router_flops(group * replicas * tokens, d, experts, capacity) / group
    slots_per_image = blocks * family.expert_rows(router, block_tokens, experts, capacity) / group
    flops += 2 * 2.0 * slots_per_image * d * expert_width  # experts at padded capacity (or none)
    flops += rows * shared_mlp  # shared experts: every token, K_s MLPs of the experts' width
  if config.classifier == Classifier.map:  # one probe query attending to every token, then an MLP
    flops += rows * (2.0 * d * d + 2.0 * tokens * d * 2 * d + 2 * 2.0 * tokens * d + 2.0 * d * d
                     + 4.0 * d * m)
  width = d
  if config.representation_size:
    flops += rows * 2.0 * d * config.representation_size
    width = config.representation_size
  return flops + rows * head_flops(config, width, num_classes, train=train)


def head_flops(config: ModelConfig, width: int, num_classes: int, *, train: bool) -> float:
  """Matmul FLOPs of the classifier head for one image (one row)."""
  head, d, k = config.head, width, num_classes
  if head.type == HeadType.det:
    return 2.0 * d * k
  s = head.train_mc_samples if train else head.eval_mc_samples
  r = head.num_factors
  q = d if head.type == HeadType.het_xl else k
  flops = 2.0 * d * k + 2.0 * d * q  # mean classifier, rank-1 scale
  flops += 2.0 * d * q if head.parameter_efficient else 2.0 * d * q * r  # v(x), or V(x)
  flops += 2.0 * s * r * q  # the draws through J (or V)
  if head.type == HeadType.het_xl:
    flops += 2.0 * s * d * k  # every noisy representation through the shared classifier
  return flops


def train_flops_per_image(config: ModelConfig, num_classes: int, *, batch_size: int) -> float:
  return 3.0 * forward_flops_per_image(config, num_classes, batch_size=batch_size, train=True)
