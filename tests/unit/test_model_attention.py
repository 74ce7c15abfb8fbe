"""Attention through `jax.nn.dot_product_attention` (model.attention=auto|xla|cudnn) against the
explicit softmax(QK^T/sqrt(d))V it replaced: a NumPy transcription (float64) of that computation as
the independent reference, and the previous flax module itself, kept here verbatim, for whole
models (ViT, V-MoE, the masked text tower) on the same parameters. Which path runs where (cuDNN,
XLA, the explicit path that alone has attention dropout) is checked with a pretend CUDA device,
since these tests run on CPUs; `cudnn` on a CPU must be refused before any compute.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config.validate import problems
from runner.config.schema import Attention, DType, ModelConfig
from runner.errors import ConfigError
from runner.models import build_model, model_config, vit
from runner.models.text import TextTransformer
from runner.models.transfer import flatten
from runner.train.state import abstract_params, init_params

TOL = 1e-5  # float32 on CPU; the two computations differ only in rounding order


class PreviousSelfAttention(nn.Module):
  """SelfAttention as it was before model.attention (runner/models/vit.py), verbatim."""
  num_heads: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  qk_norm: bool = False
  attention: str = "auto"  # ignored: the one path it had

  @nn.compact
  def __call__(self, x, *, train: bool, dropout: bool | None = None, mask=None):
    dropout = train if dropout is None else dropout
    d = x.shape[-1]
    head_dim = d // self.num_heads
    h = self.num_heads
    part = nn.with_logical_partitioning
    xavier = nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2, 3))
    w_qkv = self.param("qkv_kernel", part(xavier, ("embed", None, "heads", "kv")),
                       (d, 3, h, head_dim))
    b_qkv = self.param("qkv_bias", part(nn.initializers.zeros, (None, "heads", "kv")),
                       (3, h, head_dim))
    w_out = self.param("out_kernel", part(nn.initializers.xavier_uniform(in_axis=(0, 1), out_axis=2),
                                          ("heads", "kv", "embed")), (h, head_dim, d))
    b_out = self.param("out_bias", part(nn.initializers.zeros, ("embed",)), (d,))
    b, n, _ = x.shape
    qkv = x.reshape(b * n, d) @ w_qkv.reshape(d, 3 * h * head_dim).astype(self.dtype)
    qkv = qkv.reshape(b, n, 3, h, head_dim) + b_qkv.astype(self.dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if self.qk_norm:
      q = nn.LayerNorm(use_bias=False, dtype=self.dtype, name="query_ln")(q)
      k = nn.LayerNorm(use_bias=False, dtype=self.dtype, name="key_ln")(k)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q * head_dim**-0.5, k)
    if mask is not None:
      logits = jnp.where(mask[:, None, None, :], logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits.astype(jnp.float32)).astype(self.dtype)
    weights = nn.Dropout(self.dropout_rate)(weights, deterministic=not dropout)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b * n, h * head_dim)
    out = out @ w_out.reshape(h * head_dim, d).astype(self.dtype)
    return out.reshape(b, n, d) + b_out.astype(self.dtype)


def numpy_attention(x, params, num_heads, *, qk_norm=False, mask=None):
  """softmax(QK^T / sqrt(hd)) V per head, in float64, on SelfAttention's parameter names."""
  x = np.asarray(x, np.float64)
  p = {k: np.asarray(v, np.float64) for k, v in flatten(params).items()}
  b, n, d = x.shape
  hd = d // num_heads
  qkv = np.einsum("bnd,dthk->bnthk", x, p["qkv_kernel"]) + p["qkv_bias"]
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, S, H, hd)

  def layer_norm(y, scale):  # over each head's dimensions, no bias, flax's epsilon
    y = y - y.mean(-1, keepdims=True)
    return y / np.sqrt((y ** 2).mean(-1, keepdims=True) + 1e-6) * scale
  if qk_norm:
    q, k = layer_norm(q, p["query_ln/scale"]), layer_norm(k, p["key_ln/scale"])
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
  if mask is not None:
    logits = np.where(np.asarray(mask)[:, None, None, :], logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", weights, v)
  return np.einsum("bqhd,hde->bqe", out, p["out_kernel"]) + p["out_bias"]


def _randomised(params, seed):
  """Every parameter redrawn (biases and LayerNorm scales too), so each one matters."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, x.shape, x.dtype) + (x == 1)
                                   for k, x in zip(keys, leaves)])


def _tokens(shape=(3, 6, 32), seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _padding(batch=3, tokens=6):
  """Keys that may be attended to: the first 1, 4 and 6 (every row keeps at least one)."""
  return jnp.arange(tokens)[None, :] < jnp.array([1, 4, tokens][:batch])[:, None]


@pytest.mark.parametrize("attention", ["auto", "xla"])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_numpy(attention, qk_norm, masked):
  x, mask = _tokens(), _padding() if masked else None
  module = vit.SelfAttention(num_heads=4, qk_norm=qk_norm, attention=attention)
  params = _randomised(nn.meta.unbox(module.init(jax.random.key(0), x, train=False))["params"], 1)
  got = module.apply({"params": params}, x, train=False, mask=mask)
  want = numpy_attention(x, params, 4, qk_norm=qk_norm, mask=mask)
  np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("train", [True, False])  # False: MC dropout at inference
def test_attention_dropout_keeps_the_explicit_path(masked, train):
  """dot_product_attention has no dropout: with it on, the previous computation runs, with the
  same dropout masks from the same key."""
  x, mask = _tokens(), _padding() if masked else None
  new = vit.SelfAttention(num_heads=4, dropout_rate=0.3)
  params = _randomised(nn.meta.unbox(new.init(jax.random.key(0), x, train=False))["params"], 1)
  rngs = {"dropout": jax.random.key(5)}
  got = new.apply({"params": params}, x, train=train, dropout=True, mask=mask, rngs=rngs)
  want = PreviousSelfAttention(num_heads=4, dropout_rate=0.3).apply(
      {"params": params}, x, train=train, dropout=True, mask=mask, rngs=rngs)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  without = new.apply({"params": params}, x, train=False, mask=mask)
  assert not np.allclose(np.asarray(got), np.asarray(without))  # dropout did act


def _whole_model_parity(monkeypatch, model, inputs, **kwargs):
  """(new outputs, previous outputs) of `model` on the same parameters, which both attentions
  must create alike."""
  params, _ = init_params(model, inputs.shape[1:], seed=0) if inputs.ndim == 4 else (None, None)
  with monkeypatch.context() as patched:
    patched.setattr(vit, "SelfAttention", PreviousSelfAttention)
    if params is None:  # the text tower: tokens
      params = nn.meta.unbox(model.init(jax.random.key(0), inputs, train=False))["params"]
    previous_shapes = jax.tree.map(jnp.shape, params)
    params = _randomised(params, 2)
    before = _apply(model, params, inputs, **kwargs)
  fresh = jax.eval_shape(lambda: model.init(jax.random.key(0), inputs, train=False))["params"]
  assert jax.tree.map(jnp.shape, nn.meta.unbox(fresh)) == previous_shapes
  return _apply(model, params, inputs, **kwargs), before


def _apply(model, params, inputs, **kwargs):
  """model.apply as one compiled program (traced now: with whatever attention is patched in)."""
  return jax.jit(lambda p, x: model.apply({"params": p}, x, train=False, **kwargs))(params, inputs)


@pytest.mark.parametrize("classifier, qk_norm, moe", [
    ("token", False, False), ("token", True, False), ("gap", False, False), ("gap", True, False),
    ("token", False, True), ("gap", True, True)])
def test_whole_model_matches_the_previous_attention(monkeypatch, classifier, qk_norm, moe):
  config = dataclasses.replace(
      model_config("vmoe_tiny" if moe else "vit_tiny"), image_size=16, patch_size=4,
      hidden_size=32, num_layers=2, mlp_dim=64, num_heads=2, classifier=classifier,
      attention_qk_norm=qk_norm)
  if moe:
    config = dataclasses.replace(config, moe=dataclasses.replace(
        config.moe, layers=[1], num_experts=4, group_size=2))
  images = jnp.asarray(np.random.default_rng(3).uniform(-1, 1, (4, 16, 16, 3)), jnp.float32)
  (new, new_extras), (old, old_extras) = _whole_model_parity(
      monkeypatch, build_model(config, 10), images)
  np.testing.assert_allclose(np.asarray(new), np.asarray(old), atol=TOL, rtol=TOL)
  np.testing.assert_allclose(np.asarray(new_extras["pre_logits"]),
                             np.asarray(old_extras["pre_logits"]), atol=TOL, rtol=TOL)


def test_masked_text_tower_matches_the_previous_attention(monkeypatch):
  tokens = jnp.array([[5, 9, 2, 0, 0, 0, 0, 0], [7, 3, 3, 8, 1, 4, 6, 2],
                      [4, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)  # 0: padding, at the end
  new, old = _whole_model_parity(monkeypatch, TextTransformer(
      vocab_size=12, width=32, depth=2, mlp_dim=64, num_heads=2, pool="mean"), tokens)
  np.testing.assert_allclose(np.asarray(new), np.asarray(old), atol=TOL, rtol=TOL)


def test_auto_and_xla_agree_on_cpu():
  """On a CPU `auto` runs vmoe's own attention and `xla` jax.nn.dot_product_attention's XLA
  implementation: two programs, the same numbers within float32 rounding."""
  config = dataclasses.replace(model_config("vit_tiny"), image_size=16, patch_size=4,
                               hidden_size=32, num_layers=2, mlp_dim=64, num_heads=2)
  images = jnp.asarray(np.random.default_rng(4).uniform(-1, 1, (2, 16, 16, 3)), jnp.float32)
  models = [build_model(dataclasses.replace(config, attention=a), 10) for a in Attention
            if a != Attention.cudnn]
  params, _ = init_params(models[0], (16, 16, 3), seed=0)
  auto, xla = (_apply(m, params, images)[0] for m in models)
  np.testing.assert_allclose(np.asarray(auto), np.asarray(xla), atol=TOL, rtol=TOL)


# --- which path runs where --------------------------------------------------------------------

CUDA_HOPPER = {"platform": "cuda", "capability": (9, 0)}
CUDA_AMPERE = {"platform": "cuda", "capability": (8, 0)}
CUDA_VOLTA = {"platform": "cuda", "capability": (7, 0)}


@pytest.mark.parametrize("attention, device, dtype, head_dim, tokens, masked, dropout, path", [
    ("auto", CUDA_HOPPER, jnp.bfloat16, 64, 50, False, False, "cudnn"),
    ("auto", CUDA_HOPPER, jnp.float16, 64, 197, False, False, "cudnn"),
    ("auto", CUDA_HOPPER, jnp.float32, 64, 50, False, False, "explicit"),  # cuDNN: half precision
    ("auto", CUDA_HOPPER, jnp.bfloat16, 64, 50, False, True, "explicit"),  # attention dropout
    ("auto", CUDA_HOPPER, jnp.bfloat16, 12, 50, False, False, "explicit"),  # not a multiple of 8
    ("auto", CUDA_HOPPER, jnp.bfloat16, 192, 50, False, False, "cudnn"),
    ("auto", CUDA_AMPERE, jnp.bfloat16, 192, 50, False, False, "explicit"),  # at most 128 there
    ("auto", CUDA_VOLTA, jnp.bfloat16, 64, 50, False, False, "explicit"),  # no flash attention
    ("auto", CUDA_HOPPER, jnp.bfloat16, 64, 48, True, False, "cudnn"),  # the text tower
    ("auto", CUDA_HOPPER, jnp.bfloat16, 64, 47, True, False, "explicit"),  # a mask, odd tokens
    ("auto", {"platform": "cpu"}, jnp.bfloat16, 64, 50, False, False, "explicit"),
    ("auto", {"platform": "rocm"}, jnp.bfloat16, 64, 50, False, False, "explicit"),
    ("xla", {"platform": "cpu"}, jnp.float32, 64, 50, False, False, "xla"),
    ("xla", CUDA_HOPPER, jnp.bfloat16, 64, 50, False, False, "xla"),
    ("xla", CUDA_HOPPER, jnp.bfloat16, 64, 50, False, True, "explicit"),
    ("cudnn", CUDA_AMPERE, jnp.bfloat16, 128, 50, False, False, "cudnn"),
])
def test_attention_path(monkeypatch, attention, device, dtype, head_dim, tokens, masked, dropout,
                        path):
  monkeypatch.setattr(vit, "compute_device", lambda: device)
  assert vit.attention_path(attention, dtype, head_dim, tokens, masked=masked,
                            dropout=dropout) == path


@pytest.mark.parametrize("device, dtype, head_dim, dropout, said", [
    ({"platform": "cpu"}, jnp.bfloat16, 64, False, "this process computes on cpu"),
    (CUDA_VOLTA, jnp.bfloat16, 64, False, "compute capability 8.0"),
    (CUDA_AMPERE, jnp.bfloat16, 192, False, "at most 128"),
    (CUDA_HOPPER, jnp.float32, 64, False, "model.dtype=float32"),
    (CUDA_HOPPER, jnp.bfloat16, 64, True, "no attention dropout"),
])
def test_cudnn_where_it_cannot_run_is_refused(monkeypatch, device, dtype, head_dim, dropout, said):
  monkeypatch.setattr(vit, "compute_device", lambda: device)
  with pytest.raises(ConfigError, match="model.attention=cudnn") as refused:
    vit.attention_path("cudnn", dtype, head_dim, 50, masked=False, dropout=dropout)
  assert said in str(refused.value) and "model.attention=auto" in str(refused.value)


def test_auto_calls_the_fused_kernel_on_a_cuda_gpu(monkeypatch):
  """The model asks dot_product_attention for cuDNN where it can run (a pretend Hopper GPU;
  the call itself runs XLA's implementation on this CPU); in float32 `auto` runs vmoe's own
  attention and does not call it."""
  asked = []
  fused = jax.nn.dot_product_attention

  def recording(*args, implementation=None, **kwargs):
    asked.append(implementation)
    return fused(*args, implementation="xla", **kwargs)
  monkeypatch.setattr(vit, "compute_device", lambda: CUDA_HOPPER)
  monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
  x = _tokens((2, 6, 32))
  for dtype, want in ((jnp.bfloat16, ["cudnn"]), (jnp.float32, [])):
    asked.clear()
    module = vit.SelfAttention(num_heads=2, dtype=dtype)
    module.init(jax.random.key(0), x.astype(dtype), train=False, mask=_padding(2))
    assert asked == want


def test_an_odd_sequence_is_padded_for_cudnn_to_the_same_outputs_and_gradients():
  """cuDNN's gradient refuses an odd number of tokens (a ViT-B/16's 197 failed so on an H200):
  one padded token, masked by the sequences' lengths and dropped from the output, must leave
  every output and gradient as the unpadded attention's. Run by XLA's implementation here."""
  q, k, v = (_tokens((2, 7, 2, 8), seed) for seed in (1, 2, 3))

  def loss(pad_odd):
    def f(q, k, v):
      out = vit.fused_attention(q, k, v, mask=None, scale=8**-0.5, implementation="xla",
                                pad_odd=pad_odd)
      return jnp.sum(out * jnp.arange(out.size).reshape(out.shape) / out.size), out
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  (_, padded), padded_grads = loss(True)
  (_, plain), plain_grads = loss(False)
  assert padded.shape == plain.shape == (2, 7, 2, 8)
  np.testing.assert_allclose(padded, plain, atol=TOL)
  for a, b in zip(padded_grads, plain_grads):
    np.testing.assert_allclose(a, b, atol=TOL)


def test_cudnn_is_asked_for_an_even_sequence(monkeypatch):
  """The tokens the fused kernel sees, for 7 and 6 tokens on a pretend Hopper GPU."""
  seen = []
  fused = jax.nn.dot_product_attention

  def recording(q, k, v, *, implementation=None, query_seq_lengths=None, **kwargs):
    seen.append((q.shape[1], None if query_seq_lengths is None else int(query_seq_lengths[0])))
    return fused(q, k, v, implementation="xla", query_seq_lengths=query_seq_lengths, **kwargs)
  monkeypatch.setattr(vit, "compute_device", lambda: CUDA_HOPPER)
  monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
  for tokens in (7, 6):
    x = _tokens((2, tokens, 32)).astype(jnp.bfloat16)
    module = vit.SelfAttention(num_heads=2, dtype=jnp.bfloat16)
    module.init(jax.random.key(0), x, train=True)
  assert seen == [(8, 7), (6, None)]


def test_cudnn_on_a_cpu_is_refused_before_compute():
  """Refused when the model is traced (parameter shapes, nothing computed), naming the key."""
  config = dataclasses.replace(model_config("vit_tiny"), image_size=16, patch_size=4,
                               hidden_size=32, num_layers=2, mlp_dim=64, num_heads=2,
                               dtype=DType.bfloat16, attention=Attention.cudnn)
  assert not problems(types.SimpleNamespace(model=config))  # fine until the device
  with pytest.raises(ConfigError, match="needs an NVIDIA GPU, and this process computes on cpu"):
    abstract_params(build_model(config, 10), (16, 16, 3))


@pytest.mark.parametrize("changes, said", [
    (dict(dtype=DType.float32), "it takes bfloat16 or float16 inputs, and model.dtype=float32"),
    (dict(attention_dropout_rate=0.1), "no attention dropout"),
    (dict(hidden_size=36, num_heads=3), "a multiple of 8 of at most 256"),
    (dict(hidden_size=1024, num_heads=2), "model.hidden_size / model.num_heads = 512"),
])
def test_cudnn_that_no_gpu_could_run_is_a_config_error(changes, said):
  """Before launch, what the config alone decides (the device is the model's to check)."""
  config = dataclasses.replace(model_config("vit_tiny"), attention=Attention.cudnn,
                               **{"dtype": DType.bfloat16, **changes})
  found = problems(types.SimpleNamespace(model=config))
  assert len(found) == 1 and said in found[0] and "model.attention=cudnn" in found[0]
  for attention in (Attention.auto, Attention.xla):
    assert not problems(types.SimpleNamespace(
        model=dataclasses.replace(config, attention=attention)))
