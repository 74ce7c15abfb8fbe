"""Sections that evaluators add to a run's page: the extension seam for plug-ins
(`Evaluator.report_section`; docs/report.md). The registry of evaluators is read, not imported: a
stage that writes its page has them registered already, and `vmoe report` loads the plug-ins the
run's config names. A section that fails is reported on the page, never fatal to it."""
from __future__ import annotations

import pathlib

from runner import plugins
from runner.config.registries import EVALUATORS
from runner.report import markup


def load_plugins(config: dict) -> str | None:
  """Imports the run's plug-in modules (already imported: free); the problem in words, if any."""
  names = config.get("plugins") or []
  if not isinstance(names, list) or not names:
    return None
  try:
    plugins.load([str(n) for n in names], entry_points=False)
  except plugins.PluginError as e:
    return f"the sections of this run's plug-ins are not shown: {e}"
  return None


def sections(summary: dict, workdir: pathlib.Path) -> list[tuple[str, str, str]]:
  """(anchor, title, HTML) of every registered evaluator's section for this run."""
  found = []
  for name, cls in EVALUATORS.items():
    contribute = getattr(cls, "report_section", None)
    if not callable(contribute):
      continue
    try:
      section = contribute(summary, workdir)
    except Exception as e:  # noqa: BLE001 (a plug-in's bug must not cost the whole page)
      section = (name, markup.note(f"evaluator {name}'s report_section failed: "
                                   f"{type(e).__name__}: {e}"))
    if section:
      title, body = section
      found.append((f"evaluator-{name}", str(title), str(body)))
  return found
