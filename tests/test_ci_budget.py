""".ci/run's time budget (issue 64): CI within 35 minutes on 2 cores from a clean clone,
each step with a share of it. .ci/run measures each step and fails one past its share;
this checks, without running it, that the shares are written where the next change
sees them: every step has one, they fit the budget, and docs/INSTALL.md
gives the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
CI = (ROOT / ".ci" / "run").read_text()
ISSUE_64_MINUTES = 35


def shares() -> dict[str, int]:
    return {name: int(share) for name, share in re.findall(r"^step (\S+) (\d+)$", CI, re.M)}


def test_the_steps_shares_fit_the_budget_of_35_minutes() -> None:
    budget = int(re.search(r"^BUDGET_S=(\d+)$", CI, re.M).group(1))  # type: ignore[union-attr]
    assert budget <= ISSUE_64_MINUTES * 60
    assert shares(), "no `step NAME SHARE` line in .ci/run"
    assert sum(shares().values()) <= budget, shares()


def test_every_command_of_ci_runs_inside_a_step() -> None:
    body = CI.split("\n# ---- the steps -", 1)[1]
    first = body.index("\nstep ")
    assert not [
        line for line in body[:first].splitlines()[1:] if line.strip() and not line.startswith("#")
    ], "a command before the first step is timed by none"


def test_docs_install_gives_each_steps_share_as_ci_does() -> None:
    text = (ROOT / "docs" / "INSTALL.md").read_text()
    table = dict(re.findall(r"^\| `(\w[\w-]*)` \| (\d+) s \|", text, re.M))
    assert {name: int(share) for name, share in table.items()} == shares()
