"""Linear few-shot evaluation: closed-form ridge on frozen features (ViT / V-MoE / big_vision).

Every L2 strength of the grid is solved from one eigendecomposition. Host-side numpy in float64: the
systems are small (n or d+1 at most a few thousand) and single precision loses the small-lambda
solutions. docs/fewshot.md states the two protocols of the design matrix; with "reference"'s bias
feature of 100 the bias's penalty is 10^4 times smaller than a weight's of the same effect: almost
unregularised."""
from __future__ import annotations

from typing import Callable

import numpy as np

from runner.errors import FewShotError

# The big_vision grid: 2^-10 ... 2^19, ascending (ties in selection go to the smaller lambda).
L2_REGS = 2.0 ** np.arange(-10, 20)

PROTOCOLS = ("reference", "plain")
BIAS_CONSTANT = 100.0  # the reference's bias feature
STD_EPSILON = 1e-5  # added to the training standard deviation, as the reference does


def _matrix(x) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if x.ndim != 2:
    raise ValueError(f"features must be (num_examples, dim), got shape {x.shape}")
  return x


def protocol_name(protocol) -> str:
  """The protocol's name, from a name or the schema's enum; raises ValueError for an unknown one."""
  name = str(protocol)
  if name not in PROTOCOLS:
    raise ValueError(f"unknown few-shot protocol {name!r}; valid: {PROTOCOLS}")
  return name


def design_fn(train_x, protocol="reference") -> Callable[[np.ndarray], np.ndarray]:
  """features -> the float64 design matrix the ridge sees, fixed by the training features.
  "reference": (x - mean) / (std + 1e-5) with the training set's per-dimension mean and std
  (ddof 0), then a column of 100. "plain": x and a column of ones."""
  protocol = protocol_name(protocol)
  train_x = _matrix(train_x)
  if protocol == "reference":
    mean = train_x.mean(axis=0, keepdims=True)
    std = train_x.std(axis=0, keepdims=True) + STD_EPSILON
    bias = BIAS_CONSTANT
  else:
    mean, std, bias = 0.0, 1.0, 1.0
  dim = train_x.shape[1]

  def design(x) -> np.ndarray:
    x = _matrix(x)
    if x.shape[1] != dim:
      raise ValueError(f"features have dim {x.shape[1]}, the training features {dim}")
    return np.concatenate([(x - mean) / std, np.full((x.shape[0], 1), bias)], axis=1)
  return design


def _check_labels(y, num_classes: int, n: int, what: str) -> np.ndarray:
  y = np.asarray(y)
  if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer):
    raise ValueError(f"{what} must be {n} integer class ids, got {y.dtype} of shape {y.shape}")
  if n and (y.min() < 0 or y.max() >= num_classes):
    raise ValueError(f"{what} must lie in [0, {num_classes}), got [{y.min()}, {y.max()}]")
  return y


def _factors(x: np.ndarray, y: np.ndarray, num_classes: int):
  """(P, s, Q) of the design matrix x (n x (d+1)) and labels y; see `ridge_factors`."""
  targets = 2.0 * np.eye(num_classes)[y] - 1.0
  n, d1 = x.shape
  if n <= d1:
    s, u = np.linalg.eigh(x @ x.T)
    p, q = x.T @ u, u.T @ targets
  else:
    s, v = np.linalg.eigh(x.T @ x)
    p, q = v, v.T @ (x.T @ targets)
  # Both Gram matrices are PSD; round-off can make the null eigenvalues slightly negative.
  return p, np.maximum(s, 0.0), q


def ridge_factors(train_x, train_y, num_classes: int, protocol="reference"):
  """(P, s, Q) with W_lambda = P diag(1 / (s + lambda)) Q = (X^T X + lambda I)^-1 X^T Y. X is the
  design matrix of `protocol` (n x (d+1), see `design_fn`), Y = 2 * onehot - 1. One
  eigendecomposition serves every lambda: of the kernel X X^T (dual, P = X^T U, Q = U^T Y) when
  n <= d+1, else of X^T X (primal, P = V, Q = V^T X^T Y); the inner size is min(n, d+1)."""
  x = design_fn(train_x, protocol)(train_x)
  y = _check_labels(train_y, num_classes, x.shape[0], "train_y")
  return _factors(x, y, num_classes)


def ridge_accuracies(train_x, train_y, test_x, test_y, num_classes: int,
                     l2_regs=L2_REGS, chunk: int = 8192, protocol="reference") -> np.ndarray:
  """(len(l2_regs),) test accuracies of argmax(X_test W_lambda), one per lambda. X_test is the test
  features through the training set's design (`design_fn`: for "reference", standardised with the
  training statistics). Scores are (X_test P) diag(1 / (s + lambda)) Q: X_test P is computed once
  (in chunks of test rows to bound memory), so each lambda costs m * min(n, d+1) * C, not a weight
  matrix."""
  design = design_fn(train_x, protocol)
  x_train = design(train_x)
  y_train = _check_labels(train_y, num_classes, x_train.shape[0], "train_y")
  p, s, q = _factors(x_train, y_train, num_classes)
  test_x = _matrix(test_x)
  if test_x.shape[1] != x_train.shape[1] - 1:
    raise ValueError(f"test_x has dim {test_x.shape[1]}, train_x has {x_train.shape[1] - 1}")
  y = _check_labels(test_y, num_classes, test_x.shape[0], "test_y")
  if not len(y):
    raise ValueError("test set is empty")
  inv = 1.0 / (s[None, :] + np.asarray(l2_regs, np.float64)[:, None])
  correct = np.zeros(len(inv), np.int64)
  for start in range(0, len(y), chunk):
    a = design(test_x[start:start + chunk]) @ p
    for i, w in enumerate(inv):
      correct[i] += np.sum(np.argmax((a * w) @ q, axis=1) == y[start:start + chunk])
  return correct / len(y)


def sample_shots(labels: np.ndarray, shots: int, seed: int, num_classes: int) -> np.ndarray:
  """Indices of `shots` examples of every class, without replacement, fixed by the seed. Each
  class's examples are permuted by default_rng(seed), in class order, and the first `shots` taken:
  for one seed the k-shot sample is a subset of the (k+1)-shot one, so curves over shots are not
  noised by resampling."""
  labels = np.asarray(labels)
  if shots < 1:
    raise ValueError(f"shots must be >= 1, got {shots}")
  counts = np.bincount(labels[(labels >= 0) & (labels < num_classes)], minlength=num_classes)
  short = np.flatnonzero(counts < shots)
  if len(short):
    c = short[0]
    more = f" ({len(short) - 1} more classes too)" if len(short) > 1 else ""
    raise FewShotError(f"class {c} has {counts[c]} training examples, fewer than the {shots} "
                       f"shots asked{more}; use fewer shots or a larger training split")
  rng = np.random.default_rng(seed)
  return np.concatenate([np.flatnonzero(labels == c)[rng.permutation(counts[c])[:shots]]
                         for c in range(num_classes)])


def mean_ranks(accuracies: dict[str, np.ndarray]) -> np.ndarray:
  """Rank of every lambda per dataset (best = 0, ties share the average rank), mean over datasets.
  Ranks, not accuracies, are averaged so that datasets with a wide accuracy range do not decide the
  lambda alone."""
  if not accuracies:
    raise ValueError("no datasets to rank")
  shapes = {np.shape(a) for a in accuracies.values()}
  if len(shapes) != 1 or len(next(iter(shapes))) != 1:
    raise ValueError(f"every dataset needs one accuracy per lambda, of one length; got {shapes}")
  table = np.stack([np.asarray(a, np.float64) for a in accuracies.values()])
  better = (table[:, None, :] > table[:, :, None]).sum(-1)  # [dataset, lambda]: how many beat it
  equal = (table[:, None, :] == table[:, :, None]).sum(-1)  # including itself
  return (better + (equal - 1) / 2).mean(axis=0)


def select_by_mean_rank(accuracies: dict[str, np.ndarray]) -> int:
  """Index of the lambda with the smallest mean rank; ties -> the lowest index (smaller lambda)."""
  return int(np.argmin(mean_ranks(accuracies)))


def fewshot_metrics(features: dict[str, tuple], shots: list[int], seeds: list[int],
                    l2_regs=L2_REGS, protocol="reference") -> dict[str, float]:
  """features[name] = (train_x, train_y, test_x, test_y, num_classes); `protocol`: see the module.
  Returns {f"{name}/{s}shot/accuracy", f"mean/{s}shot/accuracy", f"mean/{s}shot/l2_reg"} for every
  dataset name and s in shots: accuracies are means over seeds, all at the one lambda chosen for s
  by mean rank across datasets."""
  protocol = protocol_name(protocol)
  l2_regs = np.asarray(l2_regs, np.float64)
  if l2_regs.ndim != 1 or not len(l2_regs) or np.any(l2_regs <= 0) or np.any(np.diff(l2_regs) <= 0):
    raise ValueError(f"l2_regs must be positive and strictly ascending, got {l2_regs}")
  if not features or not shots or not seeds:
    raise ValueError("fewshot_metrics needs at least one dataset, one number of shots and one seed")
  metrics = {}
  for s in shots:
    per_dataset = {}
    for name, (train_x, train_y, test_x, test_y, num_classes) in features.items():
      train_x, train_y = np.asarray(train_x), np.asarray(train_y)
      runs = []
      for seed in seeds:
        try:
          idx = sample_shots(train_y, s, seed, num_classes)
        except FewShotError as e:
          raise FewShotError(f"few-shot dataset {name!r}, {s} shots: {e}") from None
        runs.append(ridge_accuracies(train_x[idx], train_y[idx], test_x, test_y, num_classes,
                                     l2_regs, protocol=protocol))
      per_dataset[name] = np.mean(runs, axis=0)
    best = select_by_mean_rank(per_dataset)
    for name, acc in per_dataset.items():
      metrics[f"{name}/{s}shot/accuracy"] = float(acc[best])
    metrics[f"mean/{s}shot/accuracy"] = float(np.mean([acc[best] for acc in per_dataset.values()]))
    metrics[f"mean/{s}shot/l2_reg"] = float(l2_regs[best])
  return metrics
