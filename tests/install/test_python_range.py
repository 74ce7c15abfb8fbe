"""pyproject.toml's requires-python is the range of Pythons the pinned set installs on: each
package constraints.txt pins (jaxlib first among them) has a Linux wheel at its pinned version for
every Python the range admits, and for each Python outside it some pinned package has none.
`make install` picks its interpreter from that range (install/python.py), so a range wider than
the wheels lets an install fail half-way, and a narrower one refuses Pythons that work. Read from
the package index's metadata (PEP 691 JSON, no wheel downloaded); skipped where the index cannot
be reached."""
from __future__ import annotations

import concurrent.futures
import gzip
import json
import pathlib
import tomllib
import urllib.error
import urllib.request

import pytest
from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

ROOT = pathlib.Path(__file__).resolve().parents[2]
INDEX = "https://pypi.org/simple"
MINORS = range(8, 17)  # the 3.X series looked at: past the newest Python there is


def _pins() -> dict[str, str]:
  pins = {}
  for line in (ROOT / "constraints.txt").read_text().splitlines():
    name, eq, version = line.split("#")[0].strip().partition("==")
    if eq and "+" not in version:  # a local version (torch's +cpu) comes from its own index
      pins[name.lower()] = version
  return pins


def _files(name: str) -> list[dict]:
  request = urllib.request.Request(f"{INDEX}/{name}/", headers={
      "Accept": "application/vnd.pypi.simple.v1+json", "Accept-Encoding": "gzip"})
  with urllib.request.urlopen(request, timeout=60) as response:
    body = response.read()
    if response.headers.get("Content-Encoding") == "gzip":
      body = gzip.decompress(body)
  return json.loads(body)["files"]


def _admits(spec: str, minor: int) -> bool:
  """Whether a requires-python admits some release of 3.<minor>."""
  return any(SpecifierSet(spec).contains(f"3.{minor}.{micro}") for micro in (0, 99))


def _installs_on(files: list[dict], version: str) -> set[int]:
  """The 3.X series the pinned version has a Linux wheel for (any, for a pure-Python one; any
  its requires-python admits, for an sdist alone), within the requires-python its files say."""
  wheels, declared = [], set()
  for f in files:
    name = f["filename"]
    if f.get("yanked"):
      continue
    if name.endswith(".whl"):
      try:
        _, wheel_version, _, tags = parse_wheel_filename(name)
      except (InvalidWheelFilename, InvalidVersion):  # an old release's odd name
        continue
      if wheel_version != Version(version):
        continue
      wheels.extend(tags)
    elif not name.endswith((f"-{version}.tar.gz", f"-{version}.zip")):
      continue
    declared.add(f.get("requires-python") or "")
  minors = set() if wheels else set(MINORS)  # an sdist alone builds wherever it may
  for tag in wheels:
    if "linux" not in tag.platform and tag.platform != "any":
      continue
    if tag.abi == "none" and tag.interpreter.startswith("py3"):
      minors |= set(MINORS)
    elif tag.interpreter.startswith("cp3") and tag.abi in ("abi3", tag.interpreter):
      minor = int(tag.interpreter[3:])
      minors |= {m for m in MINORS if m >= minor} if tag.abi == "abi3" else {minor}
  return {m for m in minors if all(_admits(s, m) for s in declared)}


def test_requires_python_is_what_the_pinned_wheels_install_on():
  pins = _pins()
  assert "jaxlib" in pins
  try:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      files = dict(zip(pins, pool.map(_files, pins)))
  except urllib.error.HTTPError:
    raise  # the index answered: a pin it does not know is this test's failure
  except (urllib.error.URLError, TimeoutError) as err:
    pytest.skip(f"the package index cannot be reached ({INDEX}): {err}")
  spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
  admitted = {m for m in MINORS if _admits(spec, m)}
  lacking = {}  # 3.X -> the pinned packages without a wheel for it
  for name, version in pins.items():
    for minor in set(MINORS) - _installs_on(files[name], version):
      lacking.setdefault(minor, []).append(f"{name} {version}")
  installs = {m for m in MINORS if m not in lacking}
  assert installs, f"no Python in 3.{MINORS[0]}-3.{MINORS[-1]} has every pinned wheel: {lacking}"
  wrong = ([f"3.{m} lacks {', '.join(sorted(lacking[m]))}" for m in sorted(admitted - installs)] +
           [f"3.{m} has every wheel" for m in sorted(installs - admitted)])
  assert not wrong, (f"requires-python {spec!r} admits 3.X for X in {sorted(admitted)}, but the "
                     f"pinned set installs on {sorted(installs)}: " + "; ".join(wrong))
