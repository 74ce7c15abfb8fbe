# Experts-choice routing (Zhou et al. 2022) at inference, in PyTorch:
# vmoe's experts_choice_torch.py, which `vmoe export` copies into modeling_vmoe.py; it uses
# that file's names and imports nothing. The Flax router it mirrors: experts_choice.py.


class ExpertsChoiceRouter(nn.Module):
  """Gates softmax(x W) over the experts (float32, no noise at inference); each expert takes the
  C tokens of the group with its largest gates (ties to the lower token index), C = the V-MoE
  capacity with k = 1, at most the group's tokens. A token's output sums the gate-weighted
  outputs of the experts that took it: 0 to E of them.

  config: capacity_ratio (the one in force at inference), capacity_rounding.
  """

  def __init__(self, config: dict, dim: int, num_experts: int):
    super().__init__()
    self.config = config
    self.dense = nn.Linear(dim, num_experts, bias=False)  # one column per expert

  def forward(self, x: torch.Tensor, first: int, count: int) -> SlotPlan:
    tokens = x.shape[1]
    logits = F.linear(x.float(), self.dense.weight[first:first + count].float())
    gates = torch.softmax(logits, dim=-1).transpose(1, 2)  # (G, E, S): each expert's view
    capacity = min(tokens, expert_capacity(tokens, count, 1, self.config["capacity_ratio"],
                                           self.config["capacity_rounding"]))
    chosen = top_k(gates, capacity)  # (G, E, C) token ids
    return SlotPlan(chosen, gates.gather(-1, chosen), tokens)
