"""The documentation (README.md and docs/*.md) against the repository it describes.

- Every relative Markdown link resolves to a file or folder of the checkout.
- README.md is the front door: at most 200 lines, and it links every page of docs/.
- Every `vmoe` command shown in a code block names a real subcommand and composes against the
  config schema (unknown keys, unknown group options and type errors fail), every job of a sweep
  included. Composition reads no checkpoint and no dataset, so commands naming runs that do not
  exist here (`init.checkpoint=runs/up`, a released checkpoint) are checked all the same.

Nothing from JAX is imported when this module is collected; `runner.cli` is imported by the
command test itself.
"""
from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 200

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
# `vmoe ...`, `$ vmoe ...`, `XLA_FLAGS=... vmoe ...`
_COMMAND = re.compile(r"^(?:\$\s+)?(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*vmoe(?:\s|$)")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_TOP_LEVEL_HELP = {"-h", "--help", "help"}


def _relative(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


def _links(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line number, target) of every relative link of a page, anchors stripped."""
  found = []
  for number, line in enumerate(path.read_text().splitlines(), start=1):
    for target in _LINK.findall(line):
      if target.startswith(("http://", "https://", "mailto:", "#")):
        continue
      target = target.split("#", 1)[0]
      if target:
        found.append((number, target))
  return found


def _code_blocks(path: pathlib.Path) -> list[list[tuple[int, str]]]:
  """Each code block of a page as (line number, text) lines: fenced blocks, and runs of lines
  indented by 4 spaces or more outside them (blank lines inside an indented block are kept)."""
  blocks, current, fenced = [], [], False

  def close():
    nonlocal current
    if current:
      blocks.append(current)
    current = []

  for number, line in enumerate(path.read_text().splitlines(), start=1):
    if _FENCE.match(line):
      close()
      fenced = not fenced
      continue
    if fenced:
      current.append((number, line.strip()))
    elif line.startswith("    ") and line.strip():
      current.append((number, line.strip()))
    elif not line.strip() and current:
      continue
    else:
      close()
  close()
  return blocks


def _commands(path: pathlib.Path) -> list[tuple[int, str, str | None]]:
  """(line number, command, documented error) of every `vmoe` command in the code blocks of a
  page.

  Lines ending in a backslash are joined with the next. In a block that shows a shell session
  (lines starting with `$ `), only those lines are commands and the lines after one are its
  output; an output starting `vmoe <subcommand>: error:` is the error the command is documented
  to fail with (else None).
  """
  found = []
  for block in _code_blocks(path):
    joined, pending = [], None
    for number, text in block:
      if pending is not None:
        number, text = pending[0], pending[1] + " " + text
      if text.endswith("\\"):
        pending = (number, text[:-1].rstrip())
        continue
      pending = None
      joined.append((number, text))
    if pending is not None:
      joined.append(pending)
    session = any(text.startswith("$ ") for _, text in joined)
    for i, (number, text) in enumerate(joined):
      if session and not text.startswith("$ "):
        continue
      if not _COMMAND.match(text):
        continue
      error = None
      if session and i + 1 < len(joined) and not joined[i + 1][1].startswith("$ "):
        output = joined[i + 1][1]
        error = output if re.match(r"vmoe \S+: error: ", output) else None
      found.append((number, text[2:] if text.startswith("$ ") else text, error))
  return found


def _tokens(command: str) -> list[str]:
  """The arguments after `vmoe`: comments, environment assignments, `...` and --multirun
  dropped."""
  tokens = shlex.split(command, comments=True)
  while tokens and _ASSIGNMENT.match(tokens[0]):
    tokens.pop(0)
  assert tokens and tokens[0] == "vmoe", command
  return [t for t in tokens[1:] if t not in ("...", "--multirun", "-m")]


COMMANDS = [pytest.param(path, number, command, error, id=f"{_relative(path)}:{number}")
            for path in PAGES for number, command, error in _commands(path)]


@pytest.mark.parametrize("path", PAGES, ids=_relative)
def test_relative_links_resolve(path):
  broken = [f"{_relative(path)}:{number}: {target}" for number, target in _links(path)
            if not (path.parent / target).exists()]
  assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_readme_is_short_and_links_every_docs_page():
  lines = README.read_text().splitlines()
  assert len(lines) <= MAX_README_LINES, (
      f"README.md has {len(lines)} lines; keep it at most {MAX_README_LINES} and move detail "
      "into docs/")
  linked = {(README.parent / target).resolve() for _, target in _links(README)}
  unlinked = [_relative(page) for page in DOCS if page.resolve() not in linked]
  assert DOCS, "docs/ holds no page"
  assert not unlinked, f"docs pages README.md does not link: {unlinked}"


def test_commands_are_found():
  """The extraction itself: the README shows a command for each of the five stages."""
  shown = {_tokens(command)[0] for path, _, command, _ in (p.values for p in COMMANDS)
           if path == README and _tokens(command)}
  assert {"pretrain", "finetune", "fewshot", "eval", "ensemble"} <= shown, shown


_PLUGIN_CHECK = """
import json, sys
from runner import builtins, plugins
from runner.command import config_store, preflight
builtins.register()
commands = json.loads(sys.argv[1])
# All before the first composition, as `vmoe` loads a command's before it gives Hydra the schemas.
plugins.load([m for line in commands for m in plugins.requested(line[1:])])
config_store.register_configs()
problems = {}
for line in commands:
  sub, *rest = line
  problems[" ".join(line)] = preflight.check(sub, rest + ["--cfg", "job"]).problem
print(json.dumps(problems))
"""


@pytest.fixture(scope="module")
def plugin_commands_composed() -> dict:
  """Every documented command with `plugins=` (the examples of examples/plugins/), composed in
  one process of its own run from that folder, so that what the plug-ins register stays out of
  this one: command -> the problem found (None: it composes)."""
  commands = [_tokens(c.values[2]) for c in COMMANDS
              if any(a.startswith("plugins=") for a in _tokens(c.values[2]))]
  done = subprocess.run([sys.executable, "-c", _PLUGIN_CHECK, json.dumps(commands)],
                        cwd=ROOT / "examples" / "plugins", capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path, number, command, error", COMMANDS)
def test_documented_command_composes(path, number, command, error, monkeypatch, tmp_path,
                                     request):
  """`preflight.check(sub, args + ["--cfg", "job"])` composes every job against the schema and
  reads nothing. A command shown failing (its output `vmoe <sub>: error: ...`) is validated in
  full instead, and a config error must read as documented; an error the config check does not
  find (one a run meets, such as divergence) is not checked here."""
  from runner import cli
  from runner.command import preflight
  args = _tokens(command)
  where = f"{_relative(path)}:{number}: {command}"
  if not args or set(args) <= _TOP_LEVEL_HELP:
    return  # `vmoe --help`: the list of subcommands
  sub, rest = args[0], args[1:]
  assert sub in cli.SUBCOMMANDS, f"{where}\nunknown subcommand {sub!r}"
  if not cli.SUBCOMMANDS.get(sub).is_stage:
    _check_tool(cli, sub, rest, where, monkeypatch, tmp_path)
    return
  monkeypatch.chdir(ROOT)  # `-cd sweeps` is relative to the checkout
  if any(a.startswith("plugins=") for a in rest):
    problem = request.getfixturevalue("plugin_commands_composed")[" ".join(args)]
    assert problem is None, f"{where}\n{problem}"
    return
  if error is None:
    problem = preflight.check(sub, rest + ["--cfg", "job"]).problem
    assert problem is None, f"{where}\n{problem}"
    return
  problem = preflight.check(sub, rest).problem
  if problem is not None:
    assert f"vmoe {sub}: error: {problem}" == error, (
        f"{where}\nthe documented error is out of date; today it reads:\n"
        f"vmoe {sub}: error: {problem}")


# The module whose function named as the subcommand does its work (stubbed by _check_tool).
_TOOL_WORK = {"summarize": "runner.report.summarize", "report": "runner.report.command"}


def _check_tool(cli, sub, args, where, monkeypatch, tmp_path):
  """A plain-argument subcommand (`vmoe summarize`): its arguments parse. Its work is stubbed,
  and the folders it names exist in an empty directory."""
  import importlib
  module = importlib.import_module(cli.SUBCOMMANDS.get(sub).module)
  worker = importlib.import_module(_TOOL_WORK[sub])  # where the subcommand's work is done
  monkeypatch.setattr(worker, sub, lambda *a, **k: "", raising=True)
  monkeypatch.chdir(tmp_path)
  for arg in args:
    if not arg.startswith("-"):
      (tmp_path / arg).mkdir(parents=True, exist_ok=True)
  try:
    code = module.main(args)
  except SystemExit as e:  # argparse rejects the arguments
    code = e.code
  assert code == 0, f"{where}\nexits with {code}"


def test_the_recipes_numbers_that_pages_and_messages_state():
  """docs/howto.md's first try, and the message of a batch larger than the training split
  (runner/training/fit.py), state each stage's recipe (conf/<stage>.yaml): its batch, its steps and
  its warm-up."""
  import runner.command.config_store
  runner.command.config_store.register_configs()  # the schemas, as the CLI registers them (conftest has)
  from runner.command import compose
  from runner.training import fit
  up, down = (compose.compose(None, sub, []) for sub in ("pretrain", "finetune"))
  howto = " ".join((ROOT / "docs" / "howto.md").read_text().split())
  assert (f"pretrain's recipe takes {up.data.batch_size} images per step, finetune's "
          f"{down.data.batch_size}") in howto
  assert (f"pretrain's recipe warms the learning rate up for {up.schedule.warmup_steps} steps "
          f"of its {up.train.steps}, finetune's for {down.schedule.warmup_steps} of "
          f"{down.train.steps}") in howto
  assert fit.RECIPE_BATCHES == (f"the pretrain recipe's default is {up.data.batch_size}, "
                                f"finetune's {down.data.batch_size}")
