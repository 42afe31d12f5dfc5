"""What a full queue does: the policy names, defined here once for the emitter (its ring
or buffer), the daemon, their settings and the `tapd start` flags."""

from __future__ import annotations

from typing import Literal, get_args

Policy = Literal["block", "drop_newest"]
# The daemon also has "spool": a full subscriber queue spills to disk (tapd/daemon/spool.py),
# and only a full spool falls back to one of POLICIES.
DaemonPolicy = Literal[Policy, "spool"]

POLICIES: tuple[Policy, ...] = get_args(Policy)
DAEMON_POLICIES: tuple[DaemonPolicy, ...] = get_args(DaemonPolicy)
