"""Fewer experts per MoE layer without retraining, from what a calibration set's routing says.

Each method gives a plan: for each new expert, the old experts whose parameters it averages,
weighted by frequency (`apply_plan`).
- prune (Lu et al., ACL 2024, "Not All Experts are Equal"): of every way to keep E' of the E
  experts (`subsets`), the one whose layer output on the calibration tokens is nearest the
  layer's with all its experts (the caller measures it: runner/models/expert_statistics.py);
- prune_frequency (the merging papers' baseline): the experts the calibration tokens choose most;
- merge (HC-SMoE, Chen et al. 2024, arXiv 2410.08589): every expert's outputs averaged over the
  calibration tokens, clustered hierarchically (average linkage, Euclidean distance) into as many
  clusters as experts are kept, each cluster merged by its experts' frequency-weighted average.

A merged expert's router column (and loss-free balancing's bias) is the same weighted average of
its group's, so the router stays one linear map with one logit per expert, which a V-MoE's
softmax reads. A partitioned batch ensemble compresses each member's partition on its own."""
from __future__ import annotations

import itertools

import numpy as np

EXPERT_PARAMS = ("fc1_kernel", "fc1_bias", "fc2_kernel", "fc2_bias")  # leading axis: the expert


def subsets(experts: int, keep: int, partitions: int = 1):
  """Every way to keep `keep` experts (keep / partitions of each partition), as ascending id
  lists, in lexicographic order (so that the first of equally good ones is the lowest)."""
  per = [itertools.combinations(ids, keep // partitions) for ids in _partitions(experts, partitions)]
  for chosen in itertools.product(*per):
    yield [e for part in chosen for e in part]


def prune_plan(counts: np.ndarray, weights: np.ndarray, keep: int,
               partitions: int = 1) -> list[list[int]]:
  """The `keep` experts (keep / partitions of each partition) the calibration tokens chose most
  often (`counts`, (E,)); ties go to the larger summed routing weight (`weights`: experts-choice
  gives every expert as many tokens), then to the lower id. Groups of one, in expert order."""
  ranked = (sorted(ids, key=lambda e: (-counts[e], -weights[e], e))
            for ids in _partitions(len(counts), partitions))
  return [[e] for top in ranked for e in sorted(top[:keep // partitions])]


def average_linkage(points: np.ndarray, clusters: int) -> list[list[int]]:
  """Agglomerative clustering of `points` (N, D) into `clusters` groups: repeatedly join the two
  groups whose points are nearest on average (mean pairwise Euclidean distance); ties join the
  pair with the lowest ids first. Groups are returned by their lowest member."""
  points = np.asarray(points, np.float64)
  distance = np.sqrt(((points[:, None] - points[None]) ** 2).sum(-1))
  groups = [[i] for i in range(len(points))]
  while len(groups) > clusters:
    _, a, b = min((distance[np.ix_(groups[a], groups[b])].mean(), a, b)
                  for a in range(len(groups)) for b in range(a + 1, len(groups)))
    groups[a] = sorted(groups[a] + groups.pop(b))
  return sorted(groups)


def merge_plan(mean_outputs: np.ndarray, keep: int, partitions: int = 1) -> list[list[int]]:
  """HC-SMoE's groups: the experts' average outputs (E, D) clustered per partition into
  keep / partitions groups each."""
  return [[ids[i] for i in group] for ids in _partitions(len(mean_outputs), partitions)
          for group in average_linkage(mean_outputs[ids], keep // partitions)]


def group_weights(plan: list[list[int]], counts: np.ndarray) -> list[np.ndarray]:
  """Each group's averaging weights: its experts' shares of the group's chosen count (equal
  shares where the calibration set chose none of them)."""
  shares = [np.asarray([counts[e] for e in group], np.float64) for group in plan]
  return [f / f.sum() if f.sum() > 0 else np.full(len(f), 1 / len(f)) for f in shares]


def apply_plan(experts: dict, router: dict, plan: list[list[int]],
               counts: np.ndarray) -> tuple[dict, dict]:
  """The layer's expert parameters (EXPERT_PARAMS, leading axis E) and router parameters (a
  (D, E) `kernel`, an (E,) bias) with new expert j the frequency-weighted average of plan[j]'s."""
  weights = group_weights(plan, counts)

  def combine(value: np.ndarray, axis: int) -> np.ndarray:
    value = np.moveaxis(np.asarray(value), axis, 0)
    new = np.stack([np.tensordot(w, value[g], axes=1) for g, w in zip(plan, weights)])
    return np.moveaxis(new, 0, axis).astype(value.dtype)

  return ({k: combine(v, 0) for k, v in experts.items()},
          {k: combine(v, -1) for k, v in router.items()})


def _partitions(experts: int, partitions: int) -> list[list[int]]:
  size = experts // partitions
  return [list(range(p * size, (p + 1) * size)) for p in range(partitions)]
