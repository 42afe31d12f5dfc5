"""The suite's own scheduling (tests/conftest.py): under pytest-xdist's loadgroup, as
`scripts/test` runs it, a test that shares a module-scoped fixture carries its group in
its node id, so that its module's tests share one worker and make the fixture once
(with pytest 9.2 none did: test_host_callback_compat's emitters ran three times over)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def shared() -> str:
    return "made once"


@pytest.mark.fast
def test_a_test_of_a_module_scoped_fixture_is_grouped_under_loadgroup(
    shared: str, request: pytest.FixtureRequest
) -> None:
    if not request.config.getoption("loadgroup", False):
        pytest.skip("checks pytest-xdist's --dist loadgroup (scripts/test runs the suite so)")
    assert request.node.nodeid.endswith("@test_suite_grouping"), request.node.nodeid
