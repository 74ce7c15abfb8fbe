# Soft MoE (Puigcerver et al. 2023) at inference, in PyTorch:
# vmoe's soft_torch.py, which `vmoe export` copies into modeling_vmoe.py; it uses
# that file's names and imports nothing. The Flax router it mirrors: soft.py.


def soft_normalize(x: torch.Tensor, dim: int) -> torch.Tensor:
  """x / sqrt(sum x^2 + 1e-6) along `dim`."""
  return x * torch.rsqrt(x.square().sum(dim, keepdim=True) + 1e-6)


class SoftPlan:
  """Every slot mixes all tokens of a group, every token mixes all slots (nothing is dropped).

  dispatch_weights, combine_weights: (G, S, E * P), slot n = expert * P + p.
  """

  def __init__(self, dispatch_weights: torch.Tensor, combine_weights: torch.Tensor,
               num_experts: int):
    self.dispatch_weights, self.combine_weights = dispatch_weights, combine_weights
    self.num_experts = num_experts

  def dispatch(self, x: torch.Tensor) -> torch.Tensor:
    """(G, S, D) -> (E, G, P, D): each slot's convex combination of the group's tokens."""
    g, _, d = x.shape
    slots = torch.einsum("gsd,gsn->gnd", x, self.dispatch_weights.to(x.dtype))
    return slots.reshape(g, self.num_experts, -1, d).transpose(0, 1)

  def combine(self, y: torch.Tensor) -> torch.Tensor:
    """(E, G, P, D) -> (G, S, D): each token's convex combination of every slot's output."""
    e, g, p, d = y.shape
    slots = y.transpose(0, 1).reshape(g, e * p, d)
    return torch.einsum("gnd,gsn->gsd", slots, self.combine_weights.to(y.dtype))


class SoftRouter(nn.Module):
  """Logits L[t, n] = scale * <x_t / |x_t|, mu_n / |mu_n|> (float32); dispatch weights: a softmax
  of L over the group's tokens for each slot; combine weights: a softmax of L over the slots for
  each token.

  config: slots_per_expert (P). Parameters: mu (D, E, P), the slots' keys; scale, a scalar.
  """

  def __init__(self, config: dict, dim: int, num_experts: int):
    super().__init__()
    self.mu = nn.Parameter(torch.zeros(dim, num_experts, config["slots_per_expert"]))
    self.scale = nn.Parameter(torch.ones(()))

  def forward(self, x: torch.Tensor, first: int, count: int) -> SoftPlan:
    mu = soft_normalize(self.mu[:, first:first + count].float(), dim=0) * self.scale
    inputs = soft_normalize(x.float(), dim=-1)
    logits = torch.einsum("gsd,dn->gsn", inputs, mu.reshape(mu.shape[0], -1))
    return SoftPlan(torch.softmax(logits, dim=1), torch.softmax(logits, dim=2), count)
