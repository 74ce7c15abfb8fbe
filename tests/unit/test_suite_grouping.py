"""The suite's own set-up: tests that share an expensive module fixture run in one worker.

`make test` runs `-n 2 --dist loadgroup`: the integration modules build their runs once, in the
worker that gets their `xdist_group`. pytest 9 silently broke that (pytest-xdist 3.8 marks a
group by renaming the test's node id, which pytest 9 no longer reads), and every module fixture
was then built in both workers, minutes of the suite's budget; this test says so if it recurs.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("suite_grouping")


def _skip_unless_loadgroup(request) -> None:
  if not hasattr(request.config, "workerinput"):  # not an xdist worker
    pytest.skip("only meaningful under pytest-xdist (make test)")
  if not getattr(request.config.option, "loadgroup", False):
    pytest.skip("the run does not use --dist loadgroup")


def test_a_grouped_test_carries_its_group_under_loadgroup(request):
  _skip_unless_loadgroup(request)
  assert request.node.nodeid.endswith("@suite_grouping"), (
      f"{request.node.nodeid}: pytest-xdist's loadgroup does not group tests with this pytest; "
      "pin a pytest that it supports (constraints.txt)")


def test_a_test_without_a_group_runs_with_its_module(request):
  """tests/conftest.py gives every test without an `xdist_group` its module's, so that a module's
  fixtures and eagerly compiled operations are built in one worker, not in both."""
  _skip_unless_loadgroup(request)
  for item in request.session.items:
    module = item.nodeid.split("::")[0]
    own = sorted({m.args[0] for m in item.iter_markers("xdist_group")} - {module})
    assert item.nodeid.rsplit("@", 1)[-1] == ("_".join(own) if own else module), item.nodeid
