"""Vision Transformer with optional sparse MoE MLPs (ViT, Dosovitskiy et al.; V-MoE, Riquelme et al.).

A V-MoE is a ViT whose MLPs at `moe_layers` are `MoeMlpBlock`s. The forward pass returns logits and
extras: pre-logits (for few-shot and OOD scores), per-layer routing metrics, the summed MoE
auxiliary loss.

What the ViTs of timm and transformers vary is here too, each off by default so that vmoe's own
models are what they were: the MLPs' `activation`, `layer_norm_eps`, register tokens, layer scale,
a LayerNorm before the blocks (`pre_norm`) and one after average pooling (`fc_norm`)
(runner/checkpoints/timm_format.py and transformers_format.py map their weights onto these)."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import flax.linen as nn

from runner.accelerator import compute_device, cudnn_attention_problem
from runner.config.schema import Attention
from runner.errors import ConfigError
from runner.models import ensemble
from runner.models.activations import activate
from runner.models.heads import HeteroscedasticHead
from runner.models.moe import routers
from runner.models.moe.layer import MoeMlpBlock

part = nn.with_logical_partitioning
CLASSIFIERS = ("token", "gap", "map")
ATTENTIONS = tuple(a.value for a in Attention)  # model.attention


class MlpBlock(nn.Module):
  mlp_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  activation: str | None = None  # runner/models/activations.py; None: gelu_tanh

  @nn.compact
  def __call__(self, x, *, train: bool, dropout: bool | None = None):
    dropout = train if dropout is None else dropout
    d = x.shape[-1]
    xavier, tiny = nn.initializers.xavier_uniform(), nn.initializers.normal(1e-6)
    h = nn.Dense(self.mlp_dim, dtype=self.dtype, name="fc1",
                 kernel_init=part(xavier, ("embed", "mlp")), bias_init=part(tiny, ("mlp",)))(x)
    h = nn.Dropout(self.dropout_rate)(activate(h, self.activation), deterministic=not dropout)
    y = nn.Dense(d, dtype=self.dtype, name="fc2",
                 kernel_init=part(xavier, ("mlp", "embed")), bias_init=part(tiny, ("embed",)))(h)
    return nn.Dropout(self.dropout_rate)(y, deterministic=not dropout)


def attention_path(attention: str, dtype, head_dim: int, tokens: int, *, masked: bool,
                   dropout: bool) -> str:
  """Which attention runs: "cudnn" or "xla", the implementations of
  `jax.nn.dot_product_attention`, or "explicit", vmoe's own softmax(QK^T/sqrt(d))V (compiled by
  XLA too), the one path with attention dropout (`dropout`: on, at a rate > 0), whatever
  `attention` asks.

  `attention` (model.attention): "auto" takes cuDNN's fused kernel where it can run and vmoe's own
  attention elsewhere (what earlier versions ran; on a CPU a little faster than XLA's
  implementation, benchmarks/README.md; JAX 0.10's `implementation=None` always means XLA).
  "cudnn" raises a ConfigError at trace time where it cannot run; "xla" asks for XLA's."""
  attention = str(attention)
  if attention not in ATTENTIONS:
    raise ValueError(f"unknown attention {attention!r}; valid: {ATTENTIONS}")
  if attention != "xla":
    problem = cudnn_attention_problem(jnp.dtype(dtype).name, head_dim, dropout=dropout,
                                      tokens=tokens, masked=masked, **compute_device())
    if problem is None:
      return "cudnn"
    if attention == "cudnn":
      raise ConfigError(problem)
  return "xla" if attention == "xla" and not dropout else "explicit"


def fused_attention(q, k, v, *, mask, scale: float, implementation: str, pad_odd=None):
  """jax.nn.dot_product_attention, with an odd sequence padded by one token for cuDNN, whose
  gradient takes an even number of tokens only (ViT-B/16 at 224 px has 197; refused on an H200,
  2026-11-28): the pad is masked out by the keys' lengths and its output dropped, every real
  token's output and gradient unchanged. `pad_odd` None: for cuDNN only (which refuses a masked
  attention at an odd length, cudnn_attention_problem)."""
  n = q.shape[1]
  pad_odd = implementation == "cudnn" if pad_odd is None else pad_odd
  if not pad_odd or n % 2 == 0 or mask is not None:
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale,
                                        implementation=implementation)
  one_more = ((0, 0), (0, 1), (0, 0), (0, 0))
  lengths = jnp.full((q.shape[0],), n, jnp.int32)
  out = jax.nn.dot_product_attention(
      *(jnp.pad(t, one_more) for t in (q, k, v)), scale=scale, implementation=implementation,
      query_seq_lengths=lengths, key_value_seq_lengths=lengths)
  return out[:, :n]


class SelfAttention(nn.Module):
  """Multi-head self-attention with one fused QKV projection (one matmul instead of three).

  `qk_norm` normalises queries and keys over each head's dimensions (a LayerNorm with a scale, no
  bias: flax's `normalize_qk`, as the Soft MoE paper's ViTs; Dehghani et al. 2023). `attention`
  chooses how softmax(QK^T/sqrt(d))V is computed (`attention_path`), with the same parameters."""
  num_heads: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  qk_norm: bool = False
  attention: str = "auto"

  @nn.compact
  def __call__(self, x, *, train: bool, dropout: bool | None = None, mask=None):
    """`mask` (B, S) bool: the keys that may be attended to (padding excluded); None: all."""
    dropout = train if dropout is None else dropout
    b, n, d = x.shape
    if d % self.num_heads:
      raise ValueError(f"hidden size {d} is not divisible by num_heads {self.num_heads}")
    h, head_dim = self.num_heads, d // self.num_heads
    xavier = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2, 3))
    w_qkv = self.param("qkv_kernel", part(xavier, ("embed", None, "heads", "kv")),
                       (d, 3, h, head_dim))
    b_qkv = self.param("qkv_bias", part(nn.initializers.zeros, (None, "heads", "kv")),
                       (3, h, head_dim))
    w_out = self.param("out_kernel", part(nn.initializers.xavier_uniform(in_axis=(0, 1), out_axis=2),
                                          ("heads", "kv", "embed")), (h, head_dim, d))
    b_out = self.param("out_bias", part(nn.initializers.zeros, ("embed",)), (d,))
    # One (B*S, D) x (D, 3*H*hd) matmul; reshapes of the parameters are free.
    qkv = x.reshape(b * n, d) @ w_qkv.reshape(d, 3 * h * head_dim).astype(self.dtype)
    qkv = qkv.reshape(b, n, 3, h, head_dim) + b_qkv.astype(self.dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, S, H, hd)
    if self.qk_norm:
      q = nn.LayerNorm(use_bias=False, dtype=self.dtype, name="query_ln")(q)
      k = nn.LayerNorm(use_bias=False, dtype=self.dtype, name="key_ln")(k)
    path = attention_path(self.attention, q.dtype, head_dim, n, masked=mask is not None,
                          dropout=dropout and self.dropout_rate > 0)
    if path == "explicit":  # logits in float32 whatever the dtype (a no-op in float32)
      logits = jnp.einsum("bqhd,bkhd->bhqk", q * head_dim**-0.5, k,
                          preferred_element_type=jnp.float32)
      if mask is not None:
        logits = jnp.where(mask[:, None, None, :], logits, jnp.finfo(logits.dtype).min)
      weights = jax.nn.softmax(logits.astype(jnp.float32)).astype(self.dtype)
      weights = nn.Dropout(self.dropout_rate)(weights, deterministic=not dropout)
      out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    else:  # logits and softmax in float32 whatever the dtype; cuDNN takes the mask (B, 1, S, S)
      pairs = None if mask is None else jnp.broadcast_to(mask[:, None, None, :], (b, 1, n, n))
      out = fused_attention(q, k, v, mask=pairs, scale=head_dim**-0.5, implementation=path)
    out = out.reshape(b * n, h * head_dim) @ w_out.reshape(h * head_dim, d).astype(self.dtype)
    return out.reshape(b, n, d) + b_out.astype(self.dtype)


class EncoderBlock(nn.Module):
  """Pre-LN transformer block; the MLP is dense or a sparse mixture of experts. With
  `layer_scale` (CaiT, DeiT III, DINOv2) the attention's and the MLP's outputs are multiplied by
  learned per-channel factors `ls1`, `ls2` (initialised to it) before they join the residual."""
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  moe: dict | None = None  # keyword arguments of MoeMlpBlock, None for a dense MLP
  dtype: Any = jnp.float32
  qk_norm: bool = False
  attention: str = "auto"  # SelfAttention's
  activation: str | None = None  # the MLP's (runner/models/activations.py); None: gelu_tanh
  layer_norm_eps: float = 1e-6  # Flax's default
  layer_scale: float | None = None

  @nn.compact
  def __call__(self, x, *, train: bool, dropout: bool | None = None, mask=None):
    dropout = train if dropout is None else dropout
    d = x.shape[-1]
    scales = {}
    if self.layer_scale is not None:
      init = part(nn.initializers.constant(self.layer_scale), ("embed",))
      scales = {name: self.param(name, init, (d,)).astype(self.dtype) for name in ("ls1", "ls2")}
    y = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype, name="norm1")(x)
    y = SelfAttention(self.num_heads, self.attention_dropout_rate, self.dtype, self.qk_norm,
                      self.attention, name="attention")(y, train=train, dropout=dropout, mask=mask)
    if scales:
      y = y * scales["ls1"]
    x = x + nn.Dropout(self.dropout_rate)(y, deterministic=not dropout)
    y = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype, name="norm2")(x)
    if self.moe is None:
      y = MlpBlock(self.mlp_dim, self.dropout_rate, self.dtype, self.activation, name="mlp")(
          y, train=train, dropout=dropout)
      metrics = {}
    else:
      # `moe` may give the experts' own width (fine-grained experts are narrower).
      y, metrics = MoeMlpBlock(**{"mlp_dim": self.mlp_dim, **self.moe}, dtype=self.dtype,
                               name="moe")(y, train=train, dropout=dropout)
    if scales:
      y = y * scales["ls2"]
    return x + y, metrics


class MapHead(nn.Module):
  """Multihead attention pooling with a learned probe (used by V-MoE-15B, from Zhai et al.);
  `qk_norm` (the model's `attention_qk_norm`, as the reference's MapHead, vmoe/nn/vit_moe.py)."""
  num_heads: int
  mlp_dim: int
  dtype: Any = jnp.float32
  qk_norm: bool = False
  activation: str | None = None  # the model's
  layer_norm_eps: float = 1e-6

  @nn.compact
  def __call__(self, x, *, train: bool, dropout: bool | None = None):
    b, _, d = x.shape
    probe = self.param("probe", part(nn.initializers.xavier_uniform(), (None, None, "embed")),
                       (1, 1, d))
    probe = jnp.tile(probe, (b, 1, 1)).astype(self.dtype)
    # jax.nn.dot_product_attention (XLA's) for flax's: float32 logits and softmax under bfloat16.
    y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dtype=self.dtype,
                                        normalize_qk=self.qk_norm, name="attention",
                                        attention_fn=jax.nn.dot_product_attention)(probe, x)
    z = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype, name="norm")(y)
    y = y + MlpBlock(self.mlp_dim, dtype=self.dtype, activation=self.activation, name="mlp")(
        z, train=train, dropout=dropout)
    return y[:, 0]


class VisionTransformer(nn.Module):
  """ViT / V-MoE classifier. Argument names are the config keys under `model.`.

  A tiled partitioned batch ensemble (`moe["ensemble_size"]` M > 1, "pbe" or "tiling_only") tiles
  its representation M times right before the first MoE block, so everything before runs once;
  `logits` are the members' mean probability (`output`: softmax or sigmoid members) as logits,
  `extras["member_logits"]` (B, M, C) the members' own, `extras["pre_logits"]` their
  representations side by side (B, M*width), the joint features of few-shot and Mahalanobis.

  A heteroscedastic head (`head`, heads.py) returns the log of its MC-mean probability as logits,
  with `extras["loc_logits"]` (noise-free) and `extras["temperature"]`; the pre-logits stay
  deterministic. With `num_classes=0` the model returns its representation (contrastive.py).

  The tokens are [class token (`token`), `registers`, patches]; position embeddings are added to
  the patches only. Pooling ignores the registers: `gap` averages the patches, `map` attends to
  them (as timm pools)."""
  num_classes: int
  patch_size: int
  hidden_size: int
  num_layers: int
  mlp_dim: int
  num_heads: int
  classifier: str = "token"
  representation_size: int | None = None
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  attention_qk_norm: bool = False
  head_bias_init: float = 0.0
  moe_layers: Sequence[int] = ()
  moe: dict | None = None  # MoeMlpBlock keyword arguments shared by all MoE layers
  head: dict | None = None  # HeteroscedasticHead keyword arguments; None: a linear head
  output: str = "softmax"  # softmax or sigmoid probabilities (ensemble members, MC samples)
  dtype: Any = jnp.float32
  attention: str = "auto"  # how attention is computed (SelfAttention, attention_path)
  activation: str | None = None  # the MLPs' and experts' (runner/models/activations.py)
  layer_norm_eps: float = 1e-6  # every LayerNorm's but qk-norm's (Flax's default)
  registers: int = 0  # learned tokens after the class token (Darcet et al. 2024)
  layer_scale: float | None = None  # EncoderBlock's
  pre_norm: bool = False  # a LayerNorm on the tokens before the first block (CLIP)
  fc_norm: bool = False  # gap: the final LayerNorm after the mean, not before it (timm)

  @property
  def tiles(self) -> int:
    """Copies of each image from the first MoE block on (the members of a tiled ensemble)."""
    moe = self.moe or {}
    tiled = moe.get("ensemble_variant", "pbe") in ("pbe", "tiling_only")
    return int(moe.get("ensemble_size", 1)) if self.moe_layers and tiled else 1

  @nn.compact
  def __call__(self, images: jax.Array, *, train: bool = False, dropout: bool | None = None):
    """`dropout` (default: `train`) applies dropout at inference too: MC-dropout samples."""
    dropout = train if dropout is None else dropout
    x = self.embed(images)
    b, n, d = x.shape
    if self.classifier == "token":
      cls = self.param("cls", part(nn.initializers.zeros, (None, None, "embed")), (1, 1, d))
      x = jnp.concatenate([jnp.tile(cls, (b, 1, 1)).astype(x.dtype), x], axis=1)
    if self.registers:  # after the class token, before the patches (timm's and DINOv2's order)
      registers = self.param("registers", part(nn.initializers.normal(0.02),
                                               (None, None, "embed")), (1, self.registers, d))
      tokens = jnp.tile(registers, (b, 1, 1)).astype(x.dtype)
      first = int(self.classifier == "token")
      x = jnp.concatenate([x[:, :first], tokens, x[:, first:]], axis=1)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=not dropout)
    if self.pre_norm:
      x = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype, name="pre_norm")(x)
    routing_metrics, layers = {}, []
    for i in range(self.num_layers):
      if self.tiles > 1 and i == min(self.moe_layers):
        x = jnp.repeat(x, self.tiles, axis=0)  # image-major: row b*M + m is member m's copy
      block = EncoderBlock(self.mlp_dim, self.num_heads, self.dropout_rate,
                           self.attention_dropout_rate, name=f"block_{i}",
                           moe=self.moe if i in self.moe_layers else None, dtype=self.dtype,
                           qk_norm=self.attention_qk_norm, attention=self.attention,
                           activation=self.activation, layer_norm_eps=self.layer_norm_eps,
                           layer_scale=self.layer_scale)
      x, metrics = block(x, train=train, dropout=dropout)
      if metrics:  # a router's metrics and the losses it hands over (routers.LOSSES)
        metrics, losses = routers.split_losses(metrics)
        routing_metrics[f"layer_{i}"] = metrics
        layers.append((metrics, losses))
    x = self.pool(x, train=train, dropout=dropout)
    if self.representation_size:
      x = nn.tanh(nn.Dense(self.representation_size, dtype=self.dtype, name="pre_logits",
                           kernel_init=part(nn.initializers.lecun_normal(), ("embed", "mlp")),
                           bias_init=part(nn.initializers.zeros, ("mlp",)))(x))
    pre_logits = x
    head_extras = {}
    losses = routers.weighted_losses(layers)  # what the objective adds (and logs) by name
    if not self.num_classes:  # a representation only (the image tower of a contrastive model)
      aux = sum((m["auxiliary_loss"] for m in routing_metrics.values()), jnp.zeros(()))
      pre_logits = pre_logits.astype(jnp.float32)
      if self.tiles > 1:  # the members' representations side by side, as the joint features
        pre_logits = pre_logits.reshape(b, -1)
      return pre_logits, {"pre_logits": pre_logits, "routing": routing_metrics,
                          "auxiliary_loss": aux, "losses": losses}
    if self.head is None:  # float32 under bfloat16 compute: logits near a large bias keep digits
      logits = nn.Dense(self.num_classes, dtype=jnp.float32, name="head",
                        kernel_init=part(nn.initializers.zeros, (None, "classes")),
                        bias_init=part(nn.initializers.constant(self.head_bias_init),
                                       ("classes",)))(x.astype(jnp.float32))
    else:
      logits, head_extras = HeteroscedasticHead(
          self.num_classes, **self.head, head_bias_init=self.head_bias_init, output=self.output,
          name="head")(x, train=train)
    aux = sum((m["auxiliary_loss"] for m in routing_metrics.values()), jnp.zeros(()))
    logits, pre_logits = logits.astype(jnp.float32), pre_logits.astype(jnp.float32)
    extras = {"pre_logits": pre_logits, "routing": routing_metrics, "auxiliary_loss": aux,
              "losses": losses, **head_extras}
    if self.tiles > 1:
      extras["member_logits"] = ensemble.members(logits, self.tiles)
      if "loc_logits" in extras:
        extras["loc_logits"] = ensemble.members(extras["loc_logits"], self.tiles)
      extras["pre_logits"] = pre_logits.reshape(b, -1)
      logits = ensemble.combine_logits(extras["member_logits"], self.output)
    return logits, extras

  def pool(self, x, *, train: bool, dropout: bool):
    """The encoder's tokens -> one representation per row: the final LayerNorm (after the mean
    with `fc_norm`) and the classifier's pooling, the registers left out."""
    norm = lambda name: nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype, name=name)
    if not self.fc_norm:
      x = norm("encoder_norm")(x)
    if self.registers and self.classifier != "token":
      x = x[:, self.registers:]
    if self.classifier == "token":
      x = x[:, 0]
    elif self.classifier == "gap":
      x = x.mean(axis=1)
    elif self.classifier == "map":
      x = MapHead(self.num_heads, self.mlp_dim, self.dtype, self.attention_qk_norm,
                  self.activation, self.layer_norm_eps, name="map_head")(
                      x, train=train, dropout=dropout)
    else:
      raise ValueError(f"unknown classifier {self.classifier!r}; valid: {CLASSIFIERS}")
    return norm("fc_norm")(x) if self.fc_norm else x

  def embed(self, images):
    """Non-overlapping patches, linearly projected, plus learned position embeddings."""
    p = self.patch_size
    b, h, w, c = images.shape
    if h % p or w % p:
      raise ValueError(f"image size {h}x{w} is not divisible by patch size {p}")
    kernel = self.param("embedding_kernel",
                        part(nn.initializers.lecun_normal(), (None, None, None, "embed")),
                        (p, p, c, self.hidden_size))
    bias = self.param("embedding_bias", part(nn.initializers.zeros, ("embed",)),
                      (self.hidden_size,))
    patches = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(b, (h // p) * (w // p), p, p, c).astype(self.dtype)
    x = jnp.einsum("bnijc,ijcd->bnd", patches, kernel.astype(self.dtype)) + bias.astype(self.dtype)
    pos = self.param("pos_embedding", part(nn.initializers.normal(0.02), (None, "length", "embed")),
                     (1, x.shape[1], self.hidden_size))
    return x + pos.astype(self.dtype)
