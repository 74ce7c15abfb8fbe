"""The one base class for mistakes in the user's input (config, data, checkpoint).

The CLI prints these as one paragraph and exits with status 2, without a traceback unless
debug=true. Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
  """Bad input: the message says what was wrong and what is valid."""


class ConfigError(UserError, ValueError):
  """A config that composes but does not make sense (k > num_experts, no steps, ...)."""
