"""The defaults the documentation states, against the schema that sets them.

One convention for every page (README.md, docs/*.md, benchmarks/README.md, sweeps/README.md): a
default is written as "(default `<value>`" right after its key,

    `text.max_length` (default `48`) ids ...
    `model.moe.ensemble_size=M` (default `1`: a V-MoE, unchanged)

or, in an options table, anywhere in the row whose first cell is that one key:

    | `model.head.num_factors` | R, the rank of the low-rank covariance term (default `50`) |

Keys are full dotted paths (`model.head.num_factors`, not `head.num_factors`); <value> is written
as on the command line and read as YAML (`null`, `true`, `[]`, `0.999`, `paper`). Each claim must
be
- the key's default in runner/config/schema.py: the dataclass field's `default` or
  `default_factory` (model.router.* as the router families register them, an evaluator's eval.*
  keys as its module declares and registers them), the same in every stage's schema that has
  the key; and
- what every stage starts with: no primary config (conf/<stage>.yaml), nor a group option it
  picks by default (conf/<group>/<option>.yaml), sets the key to another value.

A default stated any other way right after a key ("`key` (default 16", "(default: ..."), a
"(default `...`" that cannot be tied to exactly one key, and an options-table header "meaning
(default)" fail, so every stated default stays in the one form this test reads. Nothing here
compiles: the schema is read as dataclasses and the configs as YAML.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import pathlib
import re
import typing

import pytest
import yaml
from omegaconf import MISSING

# The router families and evaluators add their keys (model.router.*, eval.*) to the schema
# when imported, as the CLI imports them (tests/conftest.py does too).
import runner.evaluators  # noqa: F401
import runner.models  # noqa: F401
from runner.config import schema, sections
from runner.config.subcommands import SUBCOMMANDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "benchmarks" / "README.md", ROOT / "sweeps" / "README.md"]
# The claims found when this test was written: fewer means the extractor (or the pages) lost some.
MIN_CLAIMS = 42

_KEY = r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+"
_INLINE = re.compile(rf"`({_KEY})(?:=[^`\n]*)?`\s+(\(default\s+`([^`\n]+)`)")
_MARKER = re.compile(r"\(default\s+`[^`\n]+`")
_ROW_KEY = re.compile(rf"^\|\s*`({_KEY})`\s*\|")
# A default right after a key in any other form: "(default 16", "(default: ...", "(default W)".
_LOOSE = re.compile(rf"`({_KEY})(?:=[^`\n]*)?`\s+\(default(?!\s+`)")
_TABLE_RULE = re.compile(r"^\|[\s:|-]+\|\s*$")
_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class Claim:
  page: str
  line: int
  key: str
  stated: str  # the text between the backticks

  @property
  def id(self) -> str:
    return f"{self.page}:{self.line}:{self.key}"


def _relative(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


def extract(text: str, page: str = "<text>") -> tuple[list[Claim], list[str]]:
  """(the claims of a page, what it states in another form): see the module docstring."""
  starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]

  def line_of(offset: int) -> int:
    lo, hi = 0, len(starts)
    while hi - lo > 1:
      mid = (lo + hi) // 2
      lo, hi = (mid, hi) if starts[mid] <= offset else (lo, mid)
    return lo + 1

  claims, consumed, problems = [], set(), []
  for m in _INLINE.finditer(text):
    claims.append(Claim(page, line_of(m.start(2)), m.group(1), m.group(3)))
    consumed.add(m.start(2))
  lines = text.split("\n")
  for number, (start, line) in enumerate(zip(starts, lines), start=1):
    if not line.startswith("|"):
      continue
    row_key = _ROW_KEY.match(line)
    for m in _MARKER.finditer(line):
      if start + m.start() in consumed or not row_key:
        continue
      claims.append(Claim(page, number, row_key.group(1), m.group(0).split("`")[1]))
      consumed.add(start + m.start())
    if "(default)" in line and number < len(lines) and _TABLE_RULE.match(lines[number]):
      problems.append(f"{page}:{number}: a table header with '(default)': write each row's "
                      "default as (default `<value>`) in that row")
  for m in _MARKER.finditer(text):
    if m.start() not in consumed:
      problems.append(f"{page}:{line_of(m.start())}: {m.group(0)}) belongs to no key: write it "
                      "right after one `dotted.key`, or in the row of a table whose first cell "
                      "is that one key")
  for m in _LOOSE.finditer(text):
    problems.append(f"{page}:{line_of(m.start())}: `{m.group(1)}` (default ...: write the value "
                    "in backticks, (default `<value>`)")
  return claims, problems


def _config_value(value):
  """A value as Hydra reads it: `3e-3` is the number (YAML 1.1 reads it as a string)."""
  if isinstance(value, str):
    try:
      return float(value)
    except ValueError:
      pass
  return value


def _value(text: str):
  """A value as written on the command line."""
  return _config_value(yaml.safe_load(text))


def _plain(value):
  if isinstance(value, enum.Enum):
    return value.value
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def _same(a, b) -> bool:
  a, b = _plain(a), _plain(b)
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  numbers = (int, float)
  if (isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool)
      and not isinstance(b, bool)):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
  return type(a) is type(b) and a == b


def _section(cls, f: dataclasses.Field):
  """The dataclass a field holds (None for a plain value and for schema.optional_copy's
  all-None override sections, whose "defaults" mean "unchanged")."""
  try:
    kind = typing.get_type_hints(cls)[f.name]
  except Exception:  # noqa: BLE001 - an annotation typing cannot evaluate is no section
    kind = f.type
  for candidate in (kind, *typing.get_args(kind)):
    if dataclasses.is_dataclass(candidate) and isinstance(candidate, type):
      return None if candidate.__name__.startswith("Optional") else sections.fields_class(
          candidate)
  return None


def _walk(cls, parts: list[str]):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  f = fields.get(parts[0])
  if f is None:
    return _ABSENT
  if len(parts) > 1:
    sub = _section(cls, f)
    return _ABSENT if sub is None else _walk(sub, parts[1:])
  if _section(cls, f) is not None:
    return _ABSENT  # a whole section has no default value to state
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return f.default


def schema_defaults(key: str) -> dict[str, object]:
  """{stage: the key's default} for each stage whose schema has the key."""
  found = {}
  for stage, subcommand in SUBCOMMANDS.items():
    if not subcommand.is_stage:
      continue
    value = _walk(subcommand.schema, key.split("."))
    if value is not _ABSENT:
      found[stage] = value
  return found


def _merge(into: dict, values: dict) -> None:
  for name, value in values.items():
    if isinstance(value, dict) and isinstance(into.get(name), dict):
      _merge(into[name], value)
    else:
      into[name] = value


def stage_config(path: pathlib.Path) -> dict:
  """What a primary config and the group options it picks by default set (experiment overlays
  and Hydra's own settings left out; the primary's own keys last, as its `_self_` comes after the
  groups)."""
  own = yaml.safe_load(path.read_text()) or {}
  merged: dict = {}
  for entry in own.pop("defaults", []) or []:
    if not isinstance(entry, dict):
      continue
    ((group, option),) = entry.items()
    group = str(group)
    if option is None or group.startswith("override") or "/" in group or group == "experiment":
      continue
    option_path = CONF / group / f"{option}.yaml"
    if not option_path.exists():  # a model of the catalog, a text tower: registered in Python
      continue
    text = option_path.read_text()
    values = yaml.safe_load(text) or {}
    values.pop("defaults", None)
    _merge(merged, values if "@package _global_" in text else {group: values})
  own.pop("hydra", None)
  _merge(merged, own)
  return merged


STAGES = {path.stem: stage_config(path) for path in sorted(CONF.glob("*.yaml"))}


def _set_in(config: dict, key: str):
  node = config
  for part in key.split("."):
    if not isinstance(node, dict) or part not in node:
      return _ABSENT
    node = node[part]
  return node


def check(claim: Claim) -> list[str]:
  """What is wrong with a claim (nothing: an empty list)."""
  where = f"{claim.page}:{claim.line}: `{claim.key}` (default `{claim.stated}`)"
  try:
    stated = _value(claim.stated)
  except yaml.YAMLError as e:
    return [f"{where}: the value is not YAML ({e})"]
  defaults = schema_defaults(claim.key)
  if not defaults:
    return [f"{where}: no stage's schema (runner/config/schema.py) has this key with a default"]
  wrong = []
  for stage, value in defaults.items():
    if value is dataclasses.MISSING or value == MISSING:
      wrong.append(f"{where}: the {stage} schema gives the key no default (it must be set)")
    elif not _same(stated, value):
      wrong.append(f"{where}: the {stage} schema's default is {_plain(value)!r}")
  for stage, config in STAGES.items():
    value = _set_in(config, claim.key)
    if value is not _ABSENT and not _same(stated, _config_value(value)):
      wrong.append(f"{where}: conf/{stage}.yaml (or a group option it picks) sets {value!r}, so "
                   f"`vmoe {stage}` does not start from the stated default")
  return wrong


FOUND = {_relative(page): extract(page.read_text(), _relative(page)) for page in PAGES
         if page.exists()}
CLAIMS = [claim for claims, _ in FOUND.values() for claim in claims]


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.id)
def test_stated_default_is_the_default(claim):
  problems = check(claim)
  assert not problems, "\n".join(problems)


def test_every_stated_default_is_in_the_one_form():
  problems = [p for _, found in FOUND.values() for p in found]
  assert not problems, "\n".join(problems)


def test_the_pages_state_defaults_this_test_reads():
  """The extraction itself, so that the claims test cannot pass on nothing."""
  assert len(CLAIMS) >= MIN_CLAIMS, (
      f"{len(CLAIMS)} stated defaults found, {MIN_CLAIMS} expected: did the pages or the "
      f"convention change? {[c.id for c in CLAIMS]}")
  keys = {(c.page, c.key) for c in CLAIMS}
  assert {("docs/data.md", "text.max_length"), ("docs/training.md", "schedule.timescale"),
          ("docs/heads.md", "model.head.num_factors"),
          ("docs/routing-analysis.md", "eval.routing.capacities"),
          ("docs/models.md", "model.router.noise_std")} <= keys, sorted(keys)


def test_the_extractor_reads_both_forms_and_rejects_others():
  text = "\n".join([
      "Captions become `text.max_length` (default `16`) ids; `model.moe.ensemble_size=M`",
      "(default `1`: a V-MoE).",
      "",
      "| key | meaning |",
      "|---|---|",
      "| `model.head.num_factors` | R (default `50`); see `model.head.type` (default `det`) |",
      "| `a.b`, `c.d` | two keys (default `3`) |",
      "",
      "| key | meaning (default) |",
      "|---|---|",
      "`schedule.timescale` (default W) and `optim.lr` (default: 1e-3).",
  ])
  claims, problems = extract(text)
  assert [(c.line, c.key, c.stated) for c in claims] == [
      (1, "text.max_length", "16"), (2, "model.moe.ensemble_size", "1"),
      (6, "model.head.type", "det"), (6, "model.head.num_factors", "50")]
  assert len(problems) == 4, problems  # the two-key row, the header, two loose defaults
  assert any(":7:" in p for p in problems) and any(":9:" in p for p in problems)


def test_a_wrong_default_fails_and_a_right_one_passes():
  """The check itself, on claims this repository's schema and configs decide."""
  assert check(Claim("p", 1, "text.max_length", "48")) == []
  assert check(Claim("p", 1, "text.max_length", "16"))
  assert check(Claim("p", 1, "model.router.capacity_rounding", "paper")) == []
  assert check(Claim("p", 1, "model.router.capacity_rounding", "reference"))
  assert check(Claim("p", 1, "eval.routing.capacities", "[1.0, 0.5, 0.25, 0.1]")) == []
  assert check(Claim("p", 1, "eval.routing.capacities", "[1.0, 0.5]"))
  assert check(Claim("p", 1, "model.head.share_samples_across_batch", "false")) == []
  assert check(Claim("p", 1, "model.head.share_samples_across_batch", "0"))  # a bool is a bool
  assert check(Claim("p", 1, "schedule.timescale", "null")) == []
  assert check(Claim("p", 1, "no.such_key", "1"))
  assert check(Claim("p", 1, "model.head", "null"))  # a section, not a key
  assert check(Claim("p", 1, "data.name", "mnist5k"))  # no default: each stage's config sets it
  # The schema's default, but not what a stage starts with: conf/pretrain.yaml sets 110, and
  # conf/optim/adam.yaml (pretrain's default optimizer) a weight decay of 0.1.
  assert any("conf/pretrain.yaml" in p for p in check(Claim("p", 1, "eval.every_steps", "0")))
  assert any("conf/pretrain.yaml" in p for p in check(Claim("p", 1, "optim.weight_decay", "0.0")))
