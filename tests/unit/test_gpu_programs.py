"""The train steps vmoe hands a GPU, read without one: each exported for CUDA on the CPU
(`jax.export` with platforms=["cuda"]) and its StableHLO read. On a GPU a `while` loop runs its
iterations as kernels outside the step's CUDA graph, XLA's fast sort takes one or two operands,
and a scatter with colliding indices is a storm of atomic additions: token-choice's capacity plan
has no loop and no sort (Batch Prioritized Routing: one argsort per layer), dropless one
single-key sort per layer and only scatters of unique indices."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from runner.config.schema import GroupedMatmul, ModelConfig
from runner.models import build_model, compiler_options, model_config
from runner.train import optimizers, schedules, state as state_lib
from runner.train.step import make_train_step

IMAGE, BATCH, CLASSES = 16, 4, 10


def _config(**router) -> ModelConfig:
  config = dataclasses.replace(model_config("vmoe_tiny"), image_size=IMAGE, patch_size=4,
                               hidden_size=32, num_layers=2, mlp_dim=64, num_heads=2)
  config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, layers=[0, 1],
                                                               num_experts=4, group_size=2))
  return dataclasses.replace(config, router=dataclasses.replace(config.router, **router))


def cuda_train_step(config: ModelConfig) -> str:
  """The StableHLO of the model's Adam train step, exported for CUDA."""
  model = build_model(config, CLASSES)
  shape = (IMAGE, IMAGE, 3)
  params = jax.eval_shape(lambda: state_lib.init_params(model, shape, seed=0)[0])
  schedule = schedules.make_schedule("linear", 1e-3, 100, 10)
  tx = optimizers.make_optimizer("adam", schedule, params, grad_clip_norm=1.0)
  state = state_lib.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                               opt_state=jax.eval_shape(tx.init, params))
  batch = {"image": jax.ShapeDtypeStruct((BATCH,) + shape, jnp.float32),
           "labels": jax.ShapeDtypeStruct((BATCH, CLASSES), jnp.float32)}
  step = make_train_step(model, tx, schedule, loss="softmax_xent", aux_loss_weight=0.01)
  return jax.export.export(jax.jit(step), platforms=["cuda"])(state, batch).mlir_module()


def ops(text: str, name: str) -> list[str]:
  """Each `stablehlo.<name>` op of the module with its attributes (up to their closing `}>`)."""
  return [text[m.start():text.find("}>", m.start()) + 2]
          for m in re.finditer(rf'"?stablehlo\.{name}"?[ (]', text)]


def test_token_choices_step_has_no_loop_and_no_sort():
  text = cuda_train_step(_config())
  assert ops(text, "while") == [] and ops(text, "sort") == []


def _argsorts_only(sorts: list[str]) -> bool:
  """Every sort a stable argsort: one key and its indices, the two operands a GPU's fast sort
  takes (JAX may outline it as one function that each layer calls)."""
  return bool(sorts) and all(re.match(r'"stablehlo\.sort"\(%\w+, %\w+\) <\{.*is_stable = true', s)
                             for s in sorts)


def test_batch_prioritized_routing_sorts_a_score_and_loops_never():
  text = cuda_train_step(_config(batch_priority=True))
  assert ops(text, "while") == []
  assert _argsorts_only(ops(text, "sort"))


def test_the_dropless_step_scatters_only_unique_indices_and_sorts_by_one_key():
  text = cuda_train_step(_config(dropless=True))
  assert ops(text, "while") == []
  assert _argsorts_only(ops(text, "sort"))
  scatters = ops(text, "scatter")
  assert scatters and all("unique_indices = true" in s for s in scatters), scatters


@pytest.mark.parametrize("method", ["pallas", "cudnn"])
def test_the_gpu_grouped_matmuls_export_for_cuda(method, monkeypatch):
  """pallas: its Triton kernels, no dense product over every expert; cudnn: ragged_dot itself,
  for XLA to fuse under the compiler option the step is compiled with. Traced as if on a GPU
  (the layer refuses them on a CPU, test_moe_dropless.py)."""
  monkeypatch.setattr("runner.models.moe.layer.compute_device", lambda: {"platform": "cuda"})
  config = _config(dropless=True)
  config = dataclasses.replace(config, dtype="bfloat16", moe=dataclasses.replace(
      config.moe, grouped_matmul=GroupedMatmul(method)))
  if method == "pallas":
    with pytest.raises(Exception, match="custom_call|Triton|triton"):
      cuda_train_step(config)  # jax.export asks to allow the Triton call explicitly
    return
  text = cuda_train_step(config)
  assert "ragged_dot" in text
  assert compiler_options(config) == {"xla_gpu_experimental_use_ragged_dot_fusion": True}
