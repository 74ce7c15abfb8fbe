"""`state.fresh_params`: the parameters every stage starts from (a run from scratch, and the new
parts of a fine-tune, a LiT tower or a contrastive run), computed by one compiled program: the
same tree as the init run eagerly, equal to float rounding, and the seed's own."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from runner.models import build_model, model_config
from runner.train import state as state_lib


def test_fresh_params_are_the_init_of_the_seed():
  config = dataclasses.replace(model_config("vmoe_tiny"), num_layers=1, hidden_size=8, mlp_dim=16,
                               num_heads=1, image_size=8, patch_size=4)
  model = build_model(config, 3)
  eager = nn.meta.unbox(state_lib.init_variables(model, (8, 8, 1), seed=3)["params"])
  fresh = state_lib.fresh_params(model, (8, 8, 1), seed=3)
  assert jax.tree.structure(fresh) == jax.tree.structure(eager)
  for got, want in zip(jax.tree.leaves(fresh), jax.tree.leaves(eager)):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
  other = state_lib.fresh_params(model, (8, 8, 1), seed=4)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  assert not np.allclose(flat(other), flat(fresh))


@pytest.mark.parametrize("seed", [0, 3, 2**31 - 1, 2**31 + 5, 2**32 - 1, 2**40, -3, -2**40 - 1])
def test_the_traced_seed_gives_the_keys_of_the_python_int(seed):
  """The init is traced once per model, its seed a uint32 argument: the params, gating and
  dropout keys it derives (seed, seed + 1, seed + 2) are `jax.random.key` of the Python int's,
  for seeds beyond 32 bits and negative ones too."""
  keys = jax.jit(lambda s: [jax.random.key_data(jax.random.key(s + i)) for i in range(3)])
  for i, got in enumerate(keys(state_lib._seed(seed))):
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(jax.random.key_data(jax.random.key(seed + i))))


def test_shapes_specs_and_values_come_from_one_trace():
  """abstract_params, init_params and fresh_params of one model object share one traced init
  (Flax traces a model's init in a tenth of a second or more): the second and third ask trace
  nothing new, and a negative seed's values are its eager init's."""
  config = dataclasses.replace(model_config("vmoe_tiny"), num_layers=1, hidden_size=8, mlp_dim=16,
                               num_heads=1, image_size=8, patch_size=4)
  model = build_model(config, 3)
  traces = []
  original = state_lib.init_variables
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(state_lib, "init_variables", lambda *a: traces.append(a) or original(*a))
    abstract, specs = state_lib.abstract_params(model, (8, 8, 1))
    params, init_specs = state_lib.init_params(model, (8, 8, 1), seed=-3)
    fresh = state_lib.fresh_params(model, (8, 8, 1), seed=-3)
  assert len(traces) == 1
  assert init_specs == specs
  eager = nn.meta.unbox(state_lib.init_variables(model, (8, 8, 1), seed=-3)["params"])
  for a, p, f, e in zip(*(jax.tree.leaves(t) for t in (abstract, params, fresh, eager))):
    assert a.shape == p.shape == f.shape == e.shape
    np.testing.assert_array_equal(np.asarray(p), np.asarray(f))
    np.testing.assert_allclose(np.asarray(p), np.asarray(e), rtol=1e-6, atol=1e-7)
