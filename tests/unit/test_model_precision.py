"""Mixed precision: compute in bfloat16, parameters and the router in float32 (every router
family: token-choice, experts-choice, Soft MoE, whose mixing einsums run in bfloat16)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.config import from_dict
from runner.config.schema import ModelConfig
from runner.models import build_model
from runner.train import optimizers, schedules, state as state_lib
from runner.train.step import make_train_step

CONFIG = dict(name="vmoe_test", image_size=16, patch_size=4, hidden_size=32, num_layers=2, mlp_dim=64, num_heads=2,
              moe=dict(layers=[1], num_experts=4, group_size=4), router=dict(k=2))


ROUTERS = {"token_choice": dict(k=2), "experts_choice": dict(type="experts_choice"),
           "soft": dict(type="soft")}


def _model(dtype, router="token_choice"):
  return build_model(from_dict(ModelConfig, dict(CONFIG, dtype=dtype, router=ROUTERS[router])),
                     10)


def test_bfloat16_compute_keeps_float32_parameters_and_router():
  model = _model("bfloat16")
  params, _ = state_lib.init_params(model, (16, 16, 3), seed=0)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  images = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16, 16, 3)), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, images, train=False))(params)
  text = str(jaxpr)
  assert "bf16[8,17,64]" in text  # the MLP activations are computed in bfloat16
  assert "f32[2,68,4]" in text  # router logits: 2 groups x 68 tokens x 4 experts, float32
  logits, extras = jax.jit(lambda p: model.apply({"params": p}, images, train=False))(params)
  assert logits.dtype == jnp.float32 and extras["pre_logits"].dtype == jnp.float32


@pytest.mark.parametrize("router", list(ROUTERS))
def test_bfloat16_training_step_tracks_float32(router):
  images = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16, 16, 3)), jnp.float32)
  batch = {"image": images, "labels": jax.nn.one_hot(jnp.arange(8) % 10, 10)}
  losses = {}
  for dtype in ("float32", "bfloat16"):
    model = _model(dtype, router)
    params, _ = state_lib.init_params(model, (16, 16, 3), seed=0)
    schedule = schedules.make_schedule("constant", 1e-3, 10)
    tx = optimizers.make_optimizer("adam", schedule, params)
    state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                 opt_state=tx.init(params))
    step = jax.jit(make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01))
    new_state, metrics = step(state, batch)
    assert {x.dtype for x in jax.tree.leaves(new_state.params)} == {jnp.dtype("float32")}
    losses[dtype] = float(metrics["train/loss"])
  assert np.isfinite(losses["bfloat16"])
  assert abs(losses["bfloat16"] - losses["float32"]) < 0.05 * losses["float32"]
