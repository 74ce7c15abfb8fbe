# Token-choice routing (V-MoE, Riquelme et al. 2021) at inference, in PyTorch:
# vmoe's token_choice_torch.py, which `vmoe export` copies into modeling_vmoe.py; it uses
# that file's names and imports nothing. The Flax router it mirrors: token_choice.py.


class TokenChoiceRouter(nn.Module):
  """Each token picks its TOP-k experts by gates softmax(x W) (float32, no noise at inference);
  an expert keeps at most `capacity` assignments per routing group, placed as `plan_top_k` says
  (Algorithm 1, or Batch Prioritized Routing), and drops the rest.

  config: k, capacity_ratio (the one in force at inference), capacity_rounding, batch_priority,
  priority ("max" or "sum"), and gate when it is "sigmoid" (DeepSeek-V3): scores sigmoid(x W),
  TOP-k chosen on them, and each row divided by its TOP-k's sum, so that the chosen weights sum
  to 1 (routing.py `sigmoid_gates`); balance when it is "bias" (auxiliary-loss-free
  balancing): the per-expert `balance_bias` is added to the scores that choose the TOP-k only,
  the weights being the unbiased scores (for sigmoid normalized over the chosen experts;
  routing.py `biased_gates`); and dropless when it is true: every assignment processed, as a
  capacity of S slots per expert (the group's tokens; an expert takes each token at most once,
  so nothing can drop) does.
  """

  def __init__(self, config: dict, dim: int, num_experts: int):
    super().__init__()
    self.config = config
    self.dense = nn.Linear(dim, num_experts, bias=False)  # one column per expert
    if config.get("balance", "aux_loss") == "bias":
      self.balance_bias = nn.Parameter(torch.zeros(num_experts))

  def forward(self, x: torch.Tensor, first: int, count: int) -> SlotPlan:
    c = self.config
    logits = F.linear(x.float(), self.dense.weight[first:first + count].float())
    sigmoid = c.get("gate", "softmax") == "sigmoid"
    if c.get("balance", "aux_loss") == "bias":
      scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
      select = scores + self.balance_bias[first:first + count].float()
      chosen = top_k(select, c["k"])
      gates = scores / scores.gather(-1, chosen).sum(-1, keepdim=True) if sigmoid else scores
    elif sigmoid:
      scores = torch.sigmoid(logits)
      gates = scores / scores.gather(-1, top_k(scores, c["k"])).sum(-1, keepdim=True)
      select = None
    else:
      gates = torch.softmax(logits, dim=-1)  # over the `count` experts routed among
      select = None
    if c.get("dropless"):
      capacity = x.shape[1]
    else:
      capacity = expert_capacity(x.shape[1], count, c["k"], c["capacity_ratio"],
                                 c["capacity_rounding"])
    return plan_top_k(gates, c["k"], capacity, c["batch_priority"], c["priority"],
                      select=select)
