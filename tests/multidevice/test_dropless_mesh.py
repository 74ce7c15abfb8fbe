"""Dropless token choice on 8 (fake CPU) data-parallel devices matches one device.

Under sharding=dp each device sorts its own routing groups' assignments by expert and runs the
replicated experts as grouped matmuls on them (inside shard_map, no collective); the MoE layer's
output and the gradients of its parameters and inputs equal one device's. A mesh that splits the
experts is refused (the config refuses it first: tests/unit/test_moe_dropless.py).

Runs in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/integration/test_multidevice.py starts it); skipped anywhere else.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.models.moe.layer import MoeMlpBlock
from runner.parallel import RULES, Placement, make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() != 8,
                                reason="needs 8 devices (run via test_multidevice.py)")

D, MLP, E = 16, 32, 8
IMAGES, TOKENS = 32, 6  # 16 routing groups of 2 images: 2 per device


def _block() -> MoeMlpBlock:
  return MoeMlpBlock(num_experts=E, mlp_dim=MLP, group_size=2, shared_experts=1,
                     router={"k": 2, "dropless": True, "gate": "sigmoid"})


def _grads(placement: Placement, params, x):
  block = _block()

  def loss(params, x):
    y, metrics = block.apply({"params": params}, x, train=True,
                             rngs={"gating": jax.random.key(1)})
    return jnp.sum(jnp.sin(y)) + metrics["auxiliary_loss"], y

  with placement.context():
    x = jax.device_put(x, placement.batch_sharding)
    step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    text = step.lower(params, x).compile().as_text()
    (d_params, d_x), y = step(params, x)
  return jax.tree.map(np.asarray, (d_params, d_x, y)), text


def test_data_parallel_matches_one_device():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(IMAGES, TOKENS, D)), jnp.float32)
  shapes = nn.meta.unbox(_block().init(jax.random.key(0), x, train=False))["params"]
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda a: jnp.asarray(0.5 * rng.normal(size=a.shape), jnp.float32),
                        shapes)
  one, _ = _grads(Placement(make_mesh(1, 1, devices=jax.devices()[:1]), RULES["dp"]), params, x)
  eight, text = _grads(Placement(make_mesh(8, 1), RULES["dp"]), params, x)
  assert "all-to-all" not in text
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(eight)[0], jax.tree.leaves(one)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))
  assert np.abs(one[0]["router"]["dense"]["kernel"]).max() > 0


def test_a_mesh_that_splits_the_experts_is_refused():
  x = jnp.zeros((IMAGES, TOKENS, D), jnp.float32)
  placement = Placement(make_mesh(1, 8), RULES["ep"])
  with placement.context(), pytest.raises(ValueError, match="all-to-all of expert parallelism"):
    jax.eval_shape(lambda: _block().init(jax.random.key(0), x, train=False))
