"""Errors that stop a run with one paragraph and an exit code, not a traceback (unless debug=true).

Two families, told apart by their exit code:
- `UserError` (exit 2): bad input — a config value, a dataset, a checkpoint — found before compute.
- `RunError` (exit 1): a run that cannot go on — it diverged, a checkpoint could not be saved.
A signal that stops a run after saving exits with 128 + the signal number, as shells expect.
Anything else is a bug and keeps its traceback."""


class VmoeError(Exception):
  """Stops the command: the message says what happened and what to do."""
  exit_code = 1


class UserError(VmoeError):
  """Bad input: the message says what was wrong and what is valid."""
  exit_code = 2


class ConfigError(UserError, ValueError):
  """A config that composes but does not make sense (k > num_experts, no steps, ...)."""


class CheckpointError(UserError):
  """A checkpoint path that does not exist, holds no checkpoint, is partial, corrupted, or does
  not fit the model. `reason` is the short what-is-wrong of one unreadable step."""

  def __init__(self, message: str, reason: str | None = None):
    super().__init__(message)
    self.reason = reason


class FewShotError(UserError, ValueError):
  """A few-shot problem that cannot be sampled (a class with fewer examples than shots)."""


class RunError(VmoeError):
  """The run stopped on its own: divergence, a failed checkpoint save."""


class Interrupted(VmoeError):
  """SIGINT/SIGTERM: the run saved a checkpoint and stopped; rerunning resumes."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.exit_code = 128 + int(signum)
