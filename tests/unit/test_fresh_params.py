"""`state.fresh_params`: the parameters every stage starts from (a run from scratch, and the new
parts of a fine-tune, a LiT tower or a contrastive run), computed by one compiled program: the
same tree as the init run eagerly, equal to float rounding, and the seed's own."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np

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
