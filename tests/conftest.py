"""Session hooks for the suite.

Under pytest-xdist (`-n 2`, with `--dist loadgroup` from pyproject.toml) a module-scoped
fixture is computed once on every worker that runs one of the tests using it. A module whose
tests share a costly one (a gloo job, a subprocess running a bench, a capture) computed it
twice, once per worker: 75 s for the GPU bench's dry run, about 90 s for the 4-rank
tensor-parallel job. This hook puts every test of a module in which some test uses a module- or
class-scoped fixture of its own into one xdist group named after the module
(`planner/test_breakdown`), so the fixture runs once; a test that names its own group keeps
it, and the tests of other modules are still spread one by one. Without -n it changes nothing.
"""

from __future__ import annotations

import pytest

_SHARED_SCOPES = frozenset({"module", "class"})


def _uses_a_shared_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        # the definition the test sees is the last; plugins' fixtures have an empty baseid
        if defs and defs[-1].scope in _SHARED_SCOPES and defs[-1].baseid:
            return True
    return False


def _module(item: pytest.Item) -> str:
    path = item.nodeid.split("::")[0]  # tests/planner/test_breakdown.py
    return path.removeprefix("tests/").removesuffix(".py")  # planner/test_breakdown


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the whole module: a test may also reach a shared fixture through
    # request.getfixturevalue, which its signature does not show
    shared = {_module(item) for item in items if _uses_a_shared_fixture(item)}
    for item in items:
        if item.get_closest_marker("xdist_group") is None and _module(item) in shared:
            item.add_marker(pytest.mark.xdist_group(_module(item)))


def pytest_configure(config: pytest.Config) -> None:
    # Tests build the same few architectures again and again (fresh weights each time); a
    # worker keeps their captures and rebinds them to each new model's tensors (bit-equal:
    # tests/capture/test_reuse.py). Tests of capture itself opt out (`fresh_captures`).
    import os

    import pipecompile

    pipecompile.default_cache.captures = int(os.environ.get("PIPECOMPILE_TEST_CAPTURES", "32"))
