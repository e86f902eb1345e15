"""How pytest-xdist shares the tests out among its workers (``--dist loadscope``, scripts/test.sh).

``ScopeScheduling`` is xdist's ``loadscope`` with two changes:

- the scope of a test is its module, and every browser test shares one: the tests of a module share
  its fixtures (servers, worker processes, a database), and the browser tests share one Chromium and
  one demo service (package fixtures), which each worker running some of them would start again;
- but each test of a module in ``SPREAD_TESTS`` is a scope of its own: a long walk split into a test
  per part (an operation of the API each), which the workers share rather than one of them running
  it all at the end of the run. Handed out one after the other, such a module's tests come to each
  worker together, so a worker sets the module's fixtures up once;
- the test a worker died in (a crash, a kill) is reported failed once, as xdist does, and not run
  again by the worker that takes over the rest of its scope, where it would most likely kill that
  one too, and so on until xdist gives up on replacing workers.

Scopes are handed out in the order they were collected (with ``--no-loadscope-reorder``): the
browser tests and the process-spawning integration tests first, the many quick unit tests last.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

BROWSER_TESTS = "tests/browser/"
SPREAD_TESTS = frozenset({"tests/integration/security/test_openapi_conformance.py"})


class ScopeScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        if module.startswith(BROWSER_TESTS):
            return BROWSER_TESTS
        return nodeid if module in SPREAD_TESTS else module

    def remove_node(self, node: WorkerController) -> str | None:
        workload = self.assigned_work.get(node, {})
        pending = (nodeid for unit in workload.values() for nodeid, done in unit.items() if not done)
        crashed = next(pending, None)
        if crashed is None:
            return super().remove_node(node)
        for unit in workload.values():
            if crashed in unit:
                unit[crashed] = True  # reported failed by xdist: the rest of its scope goes elsewhere
        super().remove_node(node)
        return crashed
