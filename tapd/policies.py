"""What a full queue does, shared by the emitter (its ring or buffer) and the daemon."""

from __future__ import annotations

from typing import Literal

Policy = Literal["block", "drop_newest"]
POLICIES: tuple[Policy, ...] = ("block", "drop_newest")
# The daemon also has "spool": a full subscriber queue spills to disk (tapd/daemon/spool.py),
# and only a full spool falls back to one of POLICIES.
DAEMON_POLICIES: tuple[str, ...] = (*POLICIES, "spool")
