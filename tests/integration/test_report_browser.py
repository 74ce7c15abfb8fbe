"""vmoe report's pages in a real browser: headless Chromium opens them from files with the
network unreachable, and the rendered DOM holds every section's heading, with no console
message at all (no uncaught error, no blocked request, no Content-Security-Policy violation).

Skips, saying why, where Chromium is not installed (`apt-get install -y chromium`).
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import shutil
import subprocess

import pytest

from runner.report import run_page, sweep_page

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (apt-get install -y chromium)")

# The synthetic workdirs of the unit tests, in the formats the stages write.
_spec = importlib.util.spec_from_file_location(
    "report_workdirs", pathlib.Path(__file__).parents[1] / "unit" / "test_report.py")
workdirs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workdirs)

# No network: every host resolves to nothing and any proxy request goes to a closed port.
OFFLINE = ["--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND"]


def _open(page: pathlib.Path, profile: pathlib.Path) -> tuple[str, list[str]]:
  """(the DOM after the page's script ran, the console messages Chromium logged)."""
  done = subprocess.run(
      [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", *OFFLINE,
       f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--dump-dom",
       page.resolve().as_uri()], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  console = [line for line in done.stderr.splitlines()
             if ":CONSOLE" in line or "Uncaught" in line]
  return done.stdout, console


def _headings(dom: str) -> set[str]:
  return {re.sub(r"<[^>]+>", "", h).strip() for h in re.findall(r"<h2>(.*?)</h2>", dom)}


def test_run_and_sweep_pages_render_offline_with_every_section(tmp_path):
  up = workdirs.make_run(tmp_path / "runs" / "up")
  down = workdirs.make_run(tmp_path / "runs" / "down", stage="finetune",
                           config={"init": {"checkpoint": str(up)}, "plugins": []})
  for num, lr in enumerate(("0.001", "0.01")):
    workdirs.make_run(tmp_path / "sweep" / str(num), steps=4,
                      overrides=(f"optim.lr={lr}", "seed=0"),
                      summary={"val/prec@1": 0.5 + num / 10, "val/nll": 1.0})
  pages = [run_page.write_run_page(up), run_page.write_run_page(down),
           sweep_page.write_sweep_page(tmp_path / "sweep")[-1]]
  expected = [{"Run", "Configuration", "Training curves", "Validation curves",
               "Expert load and dropped tokens", "Final metrics", "Pictures", "Checkpoints"}] * 2
  expected.append({"Jobs", "Best job", "Swept keys against the main metric",
                   "Mean ± std over seeds"})
  for page, headings in zip(pages, expected):
    dom, console = _open(page, tmp_path / "profile")
    assert headings <= _headings(dom), (page, _headings(dom))
    assert not console, f"{page}: the browser console says:\n" + "\n".join(console)
    assert "<svg" in dom
  # The sweep page's optional sort script ran (its hash is what the page's policy allows).
  assert 'title="click to sort"' in dom
