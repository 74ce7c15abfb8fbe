"""The preprocessing-spec language of `data.pp` and `data.pp_train`: "decode(3)|resize(32)|flip_lr".

The ops' modules register their factories in `OPS` (and the `corrupt` op its corruptions in
`CORRUPTIONS`) when imported, so a spec is checked here without importing TensorFlow.
"""
from __future__ import annotations

import ast

from runner.config.registries import Registry
from runner.errors import UserError

OPS: Registry = Registry("preprocessing op", "data.pp")
CORRUPTIONS: Registry = Registry("corruption", "eval.corruptions")


class PreprocessError(UserError, ValueError):
  """A preprocessing spec that cannot be parsed or names an unknown op."""
  # Raised while tf.data traces a map function, an error passes through autograph, which re-raises
  # it as its own type only if that type's __init__ is Exception's; otherwise as a StagingError,
  # which is no UserError (the CLI would print a traceback instead of the message).
  __init__ = Exception.__init__


def _parse_call(text: str) -> tuple[str, list, dict]:
  try:
    node = ast.parse(text.strip(), mode="eval").body
  except SyntaxError as e:
    raise PreprocessError(f"cannot parse preprocessing op {text!r}: {e.msg}") from None
  if isinstance(node, ast.Name):
    return node.id, [], {}
  if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
    raise PreprocessError(f"preprocessing op {text!r} is not of the form name or name(args)")
  try:
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
  except ValueError:
    raise PreprocessError(f"arguments of {text!r} must be literals (numbers, quoted strings, "
                          "tuples)") from None
  return node.func.id, args, kwargs


def parts(spec: str) -> list[str]:
  """The ops of `spec` as written ("resize(32)"), in order."""
  return [part.strip() for part in spec.split("|") if part.strip()]


def steps(spec: str) -> list[tuple[str, list, dict]]:
  """(op name, arguments, keyword arguments) of each part of `spec`, in order; names unchecked."""
  return [_parse_call(part) for part in parts(spec)]


def build(spec: str) -> list:
  """The op of each part of `spec`, in order, from its registered factory; errors name the op and
  the valid ones."""
  ops = []
  for part in parts(spec):
    name, args, kwargs = _parse_call(part)
    if name not in OPS:
      known = ", ".join(sorted(OPS.names())) or "none (runner.data registers them when imported)"
      raise PreprocessError(f"unknown preprocessing op {name!r} in {spec!r}; "
                            f"registered ops: {known}")
    try:
      ops.append(OPS.get(name)(*args, **kwargs))
    except TypeError as e:
      raise PreprocessError(f"bad arguments for preprocessing op {part!r}: {e}") from None
  return ops


# value_range's arguments in order, with their defaults (runner/data/pp_ops.py registers the op):
# [0, 255] pixels onto [-1, 1], on the "image".
VALUE_RANGE_ARGUMENTS = (("vmin", -1.0), ("vmax", 1.0), ("in_min", 0.0), ("in_max", 255.0),
                         ("key", "image"))
# The batch key under which each row carries the value_range left to the device (runner/models/
# inputs.py applies it): vmin, vmax - vmin, in_min, in_max - in_min, as value_range computes them.
DEVICE_VALUE_RANGE = "_value_range"


def value_range_arguments(args: list, kwargs: dict) -> dict:
  """A value_range op's arguments by name, defaults filled in."""
  given = dict(zip((name for name, _ in VALUE_RANGE_ARGUMENTS), args)) | kwargs
  return {name: given.get(name, default) for name, default in VALUE_RANGE_ARGUMENTS}


def device_tail(spec: str) -> dict | None:
  """The arguments of the value_range that ends `spec`, the op the jitted step may apply instead
  of the host, so that images cross to the device as uint8 pixels (a quarter of float32's
  bytes); None where the spec ends in another op."""
  name, args, kwargs = (steps(spec) or [(None, [], {})])[-1]
  return value_range_arguments(args, kwargs) if name == "value_range" else None
