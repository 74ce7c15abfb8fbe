"""install/python.py, the interpreter `make install` builds .venv with, among fake interpreters on a
PATH of their own: shell scripts that print a version as Python would, and shims that exist but do
not run (pyenv's, for a version it has not enabled). The versions come from pyproject.toml's
requires-python: the oldest and newest it admits, and one on either side of them."""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHOOSER = ROOT / "install" / "python.py"
_spec = importlib.util.spec_from_file_location("install_python", CHOOSER)
chooser = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chooser)

SPEC = chooser.requires_python()
OLDEST, NEWEST = chooser.minors(SPEC)[0], chooser.minors(SPEC)[-1]
TOO_OLD, TOO_NEW = f"3.{OLDEST - 1}.12", f"3.{NEWEST + 1}.0"


def _python(folder: pathlib.Path, name: str, version: str | None) -> pathlib.Path:
  """A fake interpreter: prints `version`, or (None) fails as an unused pyenv shim does."""
  script = folder / name
  script.write_text(f"#!/bin/sh\necho {version}\n" if version else
                    f"#!/bin/sh\necho 'pyenv: {name}: command not found' >&2\nexit 127\n")
  script.chmod(0o755)
  return script


def _choose(folder: pathlib.Path, *explicit: str) -> tuple[int, str, list[str]]:
  """(exit status, stdout, stderr's lines) of the chooser with only `folder` on PATH."""
  proc = subprocess.run([sys.executable, str(CHOOSER), *explicit], capture_output=True,
                        text=True, env={"PATH": str(folder)}, timeout=60)
  return proc.returncode, proc.stdout, proc.stderr.splitlines()


def test_the_specifier_is_read_as_pip_reads_it():
  assert chooser.admits(">=3.11,<3.14", (3, 13, 9))
  assert not chooser.admits(">=3.11,<3.14", (3, 14, 0))
  assert not chooser.admits(">=3.11,<3.14", (3, 10, 13))
  assert chooser.admits(">=3.11.2", (3, 11, 2)) and not chooser.admits(">=3.11.2", (3, 11, 1))
  assert chooser.minors(">=3.11,<3.14") == [11, 12, 13]
  assert chooser.minors(">=3.11.2,<3.13") == [11, 12]


def test_an_old_python3_gives_way_to_the_newest_that_runs(tmp_path):
  _python(tmp_path, "python3", TOO_OLD)
  _python(tmp_path, f"python3.{NEWEST}", None)
  fits = _python(tmp_path, f"python3.{OLDEST}", f"3.{OLDEST}.9")
  status, out, err = _choose(tmp_path)
  assert (status, out) == (0, f"{fits}\n")
  assert len(err) == 1, err
  assert err[0].startswith(f"Python 3.{OLDEST}.9 ({fits}): python3 is {TOO_OLD}; "
                           f"python3.{NEWEST} does not run (pyenv: python3.{NEWEST}: command not "
                           "found)")
  assert err[0].endswith(f"(requires-python {SPEC})")


def test_a_python3_that_fits_is_kept_and_a_newer_one_passed_over(tmp_path):
  python3 = _python(tmp_path, "python3", f"3.{OLDEST}.4")
  _python(tmp_path, f"python3.{NEWEST}", f"3.{NEWEST}.1")
  assert _choose(tmp_path) == (0, f"{python3}\n", [f"Python 3.{OLDEST}.4 ({python3})"])
  _python(tmp_path, "python3", TOO_NEW)
  status, out, err = _choose(tmp_path)
  assert (status, out) == (0, f"{tmp_path / f'python3.{NEWEST}'}\n")
  assert f"python3 is {TOO_NEW}" in err[0]


def test_none_that_fits_stops_with_one_line_saying_what_would(tmp_path):
  _python(tmp_path, "python3", TOO_OLD)
  _python(tmp_path, f"python3.{NEWEST}", None)
  status, out, err = _choose(tmp_path)
  assert (status, out) == (1, "")
  assert len(err) == 1, err
  assert err[0].startswith(f"vmoe's pinned packages need Python 3.{OLDEST}, ")
  assert f"(requires-python {SPEC}); python3 is {TOO_OLD}; python3.{NEWEST} does not run" in err[0]
  assert f"apt install python3.{OLDEST}-venv, uv python install 3.{NEWEST}, or pyenv" in err[0]
  assert err[0].endswith(f"make install PYTHON=/path/to/python3.{NEWEST}")
  assert "no python3 on PATH" in _choose(tmp_path / "nothing")[2][0]


def test_a_named_python_is_respected_or_refused(tmp_path):
  _python(tmp_path, "python3", f"3.{NEWEST}.0")
  named = _python(tmp_path, "mine", f"3.{OLDEST}.2")
  assert _choose(tmp_path, str(named)) == (0, f"{named}\n",
                                           [f"Python 3.{OLDEST}.2 (PYTHON={named})"])
  old = _python(tmp_path, "old", TOO_OLD)
  status, out, err = _choose(tmp_path, str(old))
  assert (status, out) == (1, "")
  assert err == [f"PYTHON={old} is Python {TOO_OLD}; vmoe's pinned packages need "
                 f"{chooser._series(SPEC)}: name one of those, or leave PYTHON unset to look for "
                 "one on PATH"]
  shim = _python(tmp_path, f"python3.{NEWEST}", None)
  status, _, err = _choose(tmp_path, str(shim))
  assert status == 1
  assert err[0].startswith(f"PYTHON={shim} does not run (pyenv: python3.{NEWEST}: command not "
                           "found); vmoe's pinned packages need")


def test_the_chooser_keeps_to_old_pythons_syntax():
  """It runs on whatever python3 the machine has (3.5 and newer): no f-strings, annotations or
  assignment expressions."""
  tree = ast.parse(CHOOSER.read_text())
  for node in ast.walk(tree):
    assert not isinstance(node, (ast.JoinedStr, ast.AnnAssign, ast.NamedExpr)), node.lineno
    if isinstance(node, ast.FunctionDef):
      assert node.returns is None and not any(a.annotation for a in node.args.args), node.name
