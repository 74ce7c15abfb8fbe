"""Contrastive losses of image-text models (docs/contrastive.md): the symmetric softmax loss (CLIP,
LiT; the HET-XL paper's Eq. 6), with HET-XL's noisy representations (its Eq. 8), and the sigmoid
loss (SigLIP). HET-XL's samples are taken a chunk at a time: B x B logits of one chunk, never S."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _correct_log_probs(queries: jax.Array, keys: jax.Array, scale) -> jax.Array:
  """(B, S) log softmax of query (n, s) over the B keys, at its own pair n."""
  logits = scale * jnp.einsum("bse,je->bsj", queries, keys)
  own = jnp.einsum("bse,be->bs", queries, keys) * scale
  return own - jax.nn.logsumexp(logits, axis=-1)


def _direction_loss(queries: jax.Array, keys: jax.Array, scale, chunk: int) -> jax.Array:
  """(B,) −log of the mean over samples of each query's softmax probability of its own pair;
  queries (B, S, E): the (noisy) classified embeddings, keys (B, E): the other tower's."""
  b, s, _ = queries.shape
  c = min(chunk, s)
  if c == s:
    lp = _correct_log_probs(queries, keys, scale)
    return -(jax.nn.logsumexp(lp, axis=1) - math.log(s))
  chunks = math.ceil(s / c)
  queries = jnp.pad(queries, [(0, 0), (0, chunks * c - s), (0, 0)])
  valid = jnp.arange(chunks * c) < s

  def body(total, i):
    part = jax.lax.dynamic_slice_in_dim(queries, i * c, c, axis=1)
    lp = _correct_log_probs(part, keys, scale)
    lp = jnp.where(jax.lax.dynamic_slice_in_dim(valid, i * c, c)[None], lp, -jnp.inf)
    return jnp.logaddexp(total, jax.nn.logsumexp(lp, axis=1)), None
  total, _ = jax.lax.scan(jax.checkpoint(body), jnp.full((b,), -jnp.inf), jnp.arange(chunks))
  return -(total - math.log(s))


def softmax_loss(zimg: jax.Array, ztxt: jax.Array, scale, *, image_samples=None,
                 text_samples=None, chunk: int = 8) -> tuple[jax.Array, dict]:
  """The symmetric softmax loss and its in-batch accuracies. zimg, ztxt (B, E): the deterministic
  embeddings (the other direction's "classifier weights"); image_samples, text_samples (B, S, E):
  HET-XL's noisy embeddings (None: the deterministic ones, S = 1: Eq. 6)."""
  images = zimg[:, None] if image_samples is None else image_samples
  texts = ztxt[:, None] if text_samples is None else text_samples
  i2t = _direction_loss(images, ztxt, scale, chunk)
  t2i = _direction_loss(texts, zimg, scale, chunk)
  loss = 0.5 * (i2t.mean() + t2i.mean())
  return loss, {"i2t_loss": i2t.mean(), "t2i_loss": t2i.mean(), **accuracies(zimg, ztxt)}


def sigmoid_loss(zimg: jax.Array, ztxt: jax.Array, scale, bias) -> tuple[jax.Array, dict]:
  """SigLIP: every (image, text) pair a binary question, positive on the diagonal; the sum over
  texts of the pairs' log-likelihoods, averaged over images."""
  logits = scale * zimg @ ztxt.T + bias
  signs = 2.0 * jnp.eye(zimg.shape[0]) - 1.0
  loss = -jnp.sum(jax.nn.log_sigmoid(signs * logits), axis=-1).mean()
  return loss, accuracies(zimg, ztxt)


def accuracies(zimg: jax.Array, ztxt: jax.Array) -> dict:
  """In-batch retrieval: how often an image's most similar text is its own, and vice versa."""
  sims = zimg @ ztxt.T
  own = jnp.arange(zimg.shape[0])
  return {"i2t_prec@1": jnp.mean(jnp.argmax(sims, axis=1) == own),
          "t2i_prec@1": jnp.mean(jnp.argmax(sims, axis=0) == own)}


def masked_sums(zimg: jax.Array, ztxt: jax.Array, scale, mask: jax.Array, *, bias=None) -> dict:
  """Sums over the real rows of an evaluation batch (padded rows neither query nor answer):
  the softmax loss of each direction (or the sigmoid loss with `bias`), the in-batch accuracies,
  and the count."""
  real = mask.astype(jnp.float32)
  sims = zimg @ ztxt.T
  keep = mask[None, :] & mask[:, None]
  own = jnp.arange(zimg.shape[0])
  floor = jnp.finfo(jnp.float32).min
  i2t = jnp.where(keep, scale * sims, floor)  # image n among the texts
  t2i = jnp.where(keep, scale * sims.T, floor)  # text n among the images
  out = {"i2t_prec@1": jnp.sum((jnp.argmax(i2t, 1) == own) * real),
         "t2i_prec@1": jnp.sum((jnp.argmax(t2i, 1) == own) * real), "count": real.sum()}
  if bias is None:
    out["i2t_loss"] = jnp.sum((jax.nn.logsumexp(i2t, 1) - jnp.diag(i2t)) * real)
    out["t2i_loss"] = jnp.sum((jax.nn.logsumexp(t2i, 1) - jnp.diag(t2i)) * real)
    out["loss"] = 0.5 * (out["i2t_loss"] + out["t2i_loss"])
  else:
    signs = 2.0 * jnp.eye(zimg.shape[0]) - 1.0
    terms = jnp.where(keep, jax.nn.log_sigmoid(signs * (scale * sims + bias)), 0.0)
    out["loss"] = -jnp.sum(terms.sum(-1) * real)
  return out
