"""The package's import contracts (pyproject.toml, [tool.importlinter]) hold: `make test` runs
import-linter, so an import against the layers, between independent rooms or closing a cycle
fails the suite with import-linter's account of it."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_import_contract_is_kept():
  lint = pathlib.Path(sys.executable).with_name("lint-imports")
  assert lint.exists(), f"{lint} is missing: install the test extra (pip install -e '.[test]')"
  declared = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
  assert declared >= 2, "pyproject.toml declares no import contracts"
  # --no-cache: nothing is written into the checkout; COLUMNS: one line per contract.
  result = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"}, timeout=300)
  output = result.stdout + result.stderr
  assert result.returncode == 0, f"lint-imports failed:\n{output}"
  # Each declared contract was checked and kept (not skipped, not missing from the run).
  assert re.search(rf"^Contracts: {declared} kept, 0 broken\.$", output, re.MULTILINE), output
  assert len(re.findall(r" KEPT( \(.*\))?$", output, re.MULTILINE)) == declared, output
