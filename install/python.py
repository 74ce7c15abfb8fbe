"""The Python interpreter `make install` builds .venv with: one that vmoe's pinned packages have
wheels for, as pyproject.toml's requires-python says (the one place that range is written).

    python3 install/python.py            # python3 if it fits, else the newest python3.X that runs
    python3 install/python.py PYTHON     # that one, or a refusal saying why

Prints the interpreter on stdout and what it chose on stderr, in one line; where none fits, exits
1 with one line naming the versions that do and how to get one. It runs on whatever python3 the
machine has, so it keeps to the standard library and to Python 3.5's syntax.
"""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")
_PROBE = "import sys; print('%d.%d.%d' % sys.version_info[:3])"


def requires_python():
  with open(os.path.join(ROOT, "pyproject.toml")) as f:
    found = re.search(r'^requires-python\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
  if not found:
    sys.exit("pyproject.toml has no requires-python for install/python.py to read")
  return found.group(1)


def _numbers(text):
  return tuple(int(n) for n in text.split("."))


def admits(spec, version):
  """Whether a version (3, 12, 1) meets a specifier such as ">=3.11,<3.14"."""
  for clause in spec.split(","):
    found = _CLAUSE.match(clause)
    if not found:
      sys.exit("install/python.py reads only >=, >, <=, <, == and != of plain versions in "
               "requires-python, not {!r}".format(clause.strip()))
    op, bound = found.group(1), _numbers(found.group(2))
    width = max(len(bound), 3)
    have, bound = (version + (0,) * 3)[:width], (bound + (0,) * width)[:width]
    if not {">=": have >= bound, "<=": have <= bound, ">": have > bound, "<": have < bound,
            "==": have == bound, "!=": have != bound}[op]:
      return False
  return True


def minors(spec):
  """The 3.X series the specifier admits some release of, oldest first."""
  return [m for m in range(40) if admits(spec, (3, m, 0)) or admits(spec, (3, m, 999))]


def probe(command):
  """(version, None) of an interpreter that runs, else (None, why not): a name on PATH may be a
  shim that does not run (pyenv's, for a version it has not enabled)."""
  try:
    proc = subprocess.run([command, "-c", _PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=30)
  except (OSError, subprocess.SubprocessError) as err:
    return None, str(err)
  found = re.match(r"^(\d+)\.(\d+)\.(\d+)$", proc.stdout.strip())
  if proc.returncode or not found:
    said = (proc.stderr.strip() or proc.stdout.strip() or "exit status %d" % proc.returncode)
    return None, said.splitlines()[0]
  return tuple(int(n) for n in found.groups()), None


def _dotted(version):
  return ".".join(str(n) for n in version)


def _series(spec):
  names = ["3.%d" % m for m in minors(spec)]
  listed = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)
  return "Python {} (requires-python {})".format(listed, spec)


def choose(explicit=None):
  """The interpreter to use, or SystemExit with the one line that says what would fit."""
  spec = requires_python()
  needs = "vmoe's pinned packages need " + _series(spec)
  if explicit:
    version, error = probe(explicit)
    if version is None:
      sys.exit("PYTHON={} does not run ({}); {}".format(explicit, error, needs))
    if not admits(spec, version):
      sys.exit("PYTHON={} is Python {}; {}: name one of those, or leave PYTHON unset to look for "
               "one on PATH".format(explicit, _dotted(version), needs))
    return explicit, "Python {} (PYTHON={})".format(_dotted(version), explicit)
  tried = []
  for name in ["python3"] + ["python3.%d" % m for m in reversed(minors(spec))]:
    path = shutil.which(name)
    if path is None:
      continue
    version, error = probe(path)
    if version is not None and admits(spec, version):
      why = "" if not tried else ": " + "; ".join(tried) + "; " + needs
      return path, "Python {} ({}){}".format(_dotted(version), path, why)
    tried.append("{} is {}".format(name, _dotted(version)) if version else
                 "{} does not run ({})".format(name, error))
  found = "; ".join(tried) if tried else "no python3 on PATH"
  sys.exit("{}; {}. Install one (apt install python3.{}-venv, uv python install 3.{}, or pyenv) "
           "and rerun, or name it: make install PYTHON=/path/to/python3.{}".format(
               needs, found, minors(spec)[0], minors(spec)[-1], minors(spec)[-1]))


def main(argv):
  path, said = choose(argv[0] if argv else None)
  print(said, file=sys.stderr)
  print(path)


if __name__ == "__main__":
  main(sys.argv[1:])
