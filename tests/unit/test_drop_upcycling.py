"""Drop-Upcycling (init.drop_upcycling_ratio; Nakamura et al., ICLR 2025) checked against what the
paper states: each expert starts as a copy of the dense MLP, and re-initialises floor(r * F) of
its F intermediate dimensions, chosen at random per expert: those columns of the first kernel and
rows of the second drawn from N(mean, std) of the dense matrix they replace; nothing else changes
(the first bias at those dimensions likewise, from the dense bias's statistics: the paper's MLPs
have none). Seeded by (seed, block), so the same on any devices; refused where it means nothing."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.models import drop_upcycling, transfer

E, D, F = 8, 16, 64


def _dense(seed=0):
  rng = np.random.default_rng(seed)
  return {"fc1/kernel": rng.normal(0.1, 0.5, (D, F)).astype(np.float32),
          "fc1/bias": rng.normal(-0.2, 0.05, (F,)).astype(np.float32),
          "fc2/kernel": rng.normal(-0.05, 0.2, (F, D)).astype(np.float32),
          "fc2/bias": rng.normal(0.0, 0.1, (D,)).astype(np.float32)}


def _copies(dense):
  """Sparse upcycling: every expert a copy of the dense MLP."""
  return {f"fc{i}_{kind}": np.broadcast_to(dense[f"fc{i}/{kind}"], (E,) + dense[f"fc{i}/{kind}"].shape).copy()
          for i in (1, 2) for kind in ("kernel", "bias")}


def _redrawn(experts, dense):
  """Per expert, the intermediate dimensions whose fc1 column, fc1 bias or fc2 row differ from
  the dense MLP's, and those sets per parameter (which must agree)."""
  sets = []
  for e in range(E):
    cols = set(np.flatnonzero((experts["fc1_kernel"][e] != dense["fc1/kernel"]).any(0)))
    bias = set(np.flatnonzero(experts["fc1_bias"][e] != dense["fc1/bias"]))
    rows = set(np.flatnonzero((experts["fc2_kernel"][e] != dense["fc2/kernel"]).any(1)))
    sets.append((cols, bias, rows))
  return sets


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0])
def test_each_expert_redraws_floor_r_f_dimensions_of_its_own(ratio):
  dense = _dense()
  out = drop_upcycling.drop_upcycle(_copies(dense), ratio, np.random.default_rng(0))
  count = int(ratio * F)
  chosen = []
  for cols, bias, rows in _redrawn(out, dense):
    assert cols == bias == rows and len(cols) == count
    chosen.append(frozenset(cols))
    e = len(chosen) - 1
    kept = sorted(set(range(F)) - cols)  # the rest of the expert is the dense MLP, exactly
    np.testing.assert_array_equal(out["fc1_kernel"][e][:, kept], dense["fc1/kernel"][:, kept])
    np.testing.assert_array_equal(out["fc2_kernel"][e][kept], dense["fc2/kernel"][kept])
  np.testing.assert_array_equal(out["fc2_bias"], _copies(dense)["fc2_bias"])
  if 0 < ratio < 1:  # chosen at random per expert: 8 experts do not all draw the same half
    assert len(set(chosen)) > 1


def test_redrawn_values_follow_the_dense_matrices_statistics():
  """N(mean, std) of the dense matrix each replaces, not the model's fresh initialisation."""
  dense = _dense()
  out = drop_upcycling.drop_upcycle(_copies(dense), 0.5, np.random.default_rng(1))
  new = {"fc1/kernel": [], "fc1/bias": [], "fc2/kernel": []}
  for e, (dims, _, _) in enumerate(_redrawn(out, dense)):
    dims = sorted(dims)
    new["fc1/kernel"].append(out["fc1_kernel"][e][:, dims].ravel())
    new["fc1/bias"].append(out["fc1_bias"][e][dims])
    new["fc2/kernel"].append(out["fc2_kernel"][e][dims].ravel())
  for name, values in new.items():
    values = np.concatenate(values).astype(np.float64)
    want_mean, want_std = dense[name].mean(), dense[name].std()
    sem = want_std / np.sqrt(values.size)
    assert abs(values.mean() - want_mean) < 5 * sem, name
    assert values.std() == pytest.approx(want_std, rel=0.15 if name == "fc1/bias" else 0.05), name


def test_through_the_checkpoint_mapping_seeded_per_block():
  """adapt_params with init.dense_to_experts and a ratio: the blocks' experts drop-upcycled from
  their dense MLPs, the same for the same seed, other draws for another; ratio 0: plain copies."""
  dense = {f"block_{b}/mlp/{k}": v for b in (1, 3) for k, v in _dense(b).items()}
  fresh = {f"block_{b}/moe/experts/{k}": np.zeros_like(v) for b in (1, 3)
           for k, v in _copies(_dense(b)).items()}
  for b in (1, 3):
    fresh[f"block_{b}/moe/router/dense/kernel"] = np.full((D, E), 0.5, np.float32)

  def adapt(ratio, seed):
    out = transfer.adapt_params(transfer.unflatten(dense), transfer.unflatten(fresh),
                                dense_to_experts=True, drop_upcycling=(ratio, seed))
    return transfer.flatten(out)
  first, again, other, copies = adapt(0.5, 7), adapt(0.5, 7), adapt(0.5, 8), adapt(0.0, 7)
  for b in (1, 3):
    block = {k.rsplit("/", 1)[1]: np.asarray(v) for k, v in first.items()
             if k.startswith(f"block_{b}/moe/experts/")}
    assert all(len(c) == F // 2 for c, _, _ in _redrawn(block, _dense(b)))
    np.testing.assert_array_equal(copies[f"block_{b}/moe/experts/fc1_kernel"],
                                  _copies(_dense(b))["fc1_kernel"])
    np.testing.assert_array_equal(first[f"block_{b}/moe/router/dense/kernel"], 0.5)  # fresh
  for name in first:
    np.testing.assert_array_equal(first[name], again[name])
  assert not np.array_equal(first["block_1/moe/experts/fc1_kernel"],
                            other["block_1/moe/experts/fc1_kernel"])
  # A block's draws do not depend on the other blocks (seeded by its index, not by the order).
  alone = transfer.flatten(transfer.adapt_params(
      transfer.unflatten({k: v for k, v in dense.items() if k.startswith("block_3")}),
      transfer.unflatten({k: v for k, v in fresh.items() if k.startswith("block_3")}),
      dense_to_experts=True, drop_upcycling=(0.5, 7)))
  np.testing.assert_array_equal(alone["block_3/moe/experts/fc2_kernel"],
                                first["block_3/moe/experts/fc2_kernel"])


@pytest.mark.parametrize("args, said", [
    (["init.drop_upcycling_ratio=0.5"], "init.dense_to_experts=false copies none"),
    (["init.drop_upcycling_ratio=1.5"], "must be in [0, 1]"),
    (["init.drop_upcycling_ratio=0.001", "init.dense_to_experts=true"],
     "floor(0.001 x 512) = 0 of an expert's 512 intermediate dimensions"),
])
def test_where_it_means_nothing_it_is_refused(args, said, run_cli, tmp_path):
  code, _, err = run_cli("pretrain", "model=vmoe_tiny", *args, f"workdir={tmp_path / 'run'}")
  assert code == 2 and said in err and "Traceback" not in err, err
  assert not (tmp_path / "run").exists()
