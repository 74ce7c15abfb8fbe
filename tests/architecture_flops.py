"""FLOPs counted from a model's architecture, independently of runner/models/flops.py, for the
tests that check the analytic and XLA counts of a run."""
from __future__ import annotations


def dense_twin_flops(model: dict, num_classes: int) -> float:
  """Forward matmul FLOPs per image of the ViT of the same sizes, counted from the architecture
  ((m x k) @ (k x n) costs 2mkn): patch embedding, per block q/k/v, the T x T scores and their
  weighted sum, the output projection and the two MLP layers, then the head."""
  d, m, p = model["hidden_size"], model["mlp_dim"], model["patch_size"]
  patches = (model["image_size"] // p) ** 2
  tokens = patches + (model["classifier"] == "token")
  block = 2 * tokens * d * 3 * d + 2 * 2 * tokens * tokens * d + 2 * tokens * d * d
  block += 2 * tokens * d * m + 2 * tokens * m * d
  return 2 * patches * p * p * 3 * d + model["num_layers"] * block + 2 * d * num_classes
