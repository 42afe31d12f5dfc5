"""A subscriber's taps read from shared memory: the `ring_tap`s of a daemon on this host,
whose bytes are in the emitter's ring (tapd/daemon/targets/shm.py sends them).

`RingTaps` decides, per daemon, whether this subscriber reads rings at all (an ipc://
daemon, `shm=` or TAPD_SHM_SUBSCRIBERS), reads each `ring_tap` as a `tap` message
(tapd_client/shm.py does the reading and its checks) and runs its handler on it. A
ring tap that cannot be read is one failure, its reason sent back with the ack.
"""

from __future__ import annotations

import logging
from typing import Any

from tapd.errors import ConfigError
from tapd.protocol import Message
from tapd.protocol.batch import SiteRun
from tapd_client.daemon_link import DaemonLink
from tapd_client.handlers import Handlers
from tapd_client.shm import RingReader, RingReadError, released_while_read, ring_directory

logger = logging.getLogger("tapd.subscriber")


class RingTaps:
    """`shm`: read the rings of a daemon on this host (None: TAPD_SHM_SUBSCRIBERS).
    `views`: handlers get read-only views of the ring, valid only during their call,
    instead of copies (tapd_client/shm.py)."""

    def __init__(self, shm: bool | None, views: bool) -> None:
        self.shm = shm
        self.views = views
        self.read = 0  # taps read from a ring, not received as bytes

    def reader_for(self, endpoint: str) -> RingReader | None:
        """Where a link to `endpoint` reads rings, if it does."""
        directory = ring_directory(endpoint, self.shm)
        return None if directory is None else RingReader(directory)

    def run_batch(self, link: DaemonLink, message: Message, handlers: Handlers) -> None:
        """Read the spans of a `ring_taps` message and run their handlers on them, as on
        a `taps` message's runs; a span that cannot be read fails each of its taps."""
        spans = message.spans
        if link.rings is None:
            nowhere = RingReadError("this subscriber reads no rings from this daemon")
            read: list[SiteRun | RingReadError] = [nowhere] * len(spans)
        else:
            read = link.rings.read_spans(spans, views=self.views)
        runs = []
        for span, run in zip(spans, read, strict=True):
            if isinstance(run, SiteRun):
                runs.append(run)
            else:
                self._refused(link, handlers, span.rows, run)
        self.read += sum(len(run) for run in runs)
        handlers.handle_taps(link, runs)
        if self.views and link.rings is not None:  # what the handlers read must be intact
            for span, run in zip(spans, read, strict=True):
                if isinstance(run, SiteRun) and link.rings.torn(span):
                    torn = RingReadError(released_while_read(span.ring))
                    self._refused(link, handlers, span.rows, torn)

    def _refused(
        self, link: DaemonLink, handlers: Handlers, rows: list[list[Any]], why: RingReadError
    ) -> None:
        handlers.failed += len(rows)
        logger.error(
            "refused %d ring taps from the daemon at %s: %s", len(rows), link.endpoint, why
        )
        for row in rows:
            link.fail(row[1], f"the subscriber could not read this tap: {why}")
            link.last_tid = max(link.last_tid, row[1])

    def run(self, link: DaemonLink, header: dict[str, Any], handlers: Handlers) -> None:
        """Read the tap a `ring_tap` header describes and run its handler on it."""
        tid = header.get("tid")
        if type(tid) is not int:
            logger.error("tap from the daemon at %s without a delivery id; ignored", link.endpoint)
            return
        try:
            if link.rings is None:
                raise RingReadError("this subscriber reads no rings from this daemon")
            tap, intact = link.rings.read(header, views=self.views)
            self.read += 1
            # (views: the handler must have read what the emitter wrote)
            handlers.run_handler(link, tap, check=intact if self.views else None)
        except (RingReadError, ConfigError) as exc:
            handlers.failed += 1
            logger.error("refused a ring tap from the daemon at %s: %s", link.endpoint, exc)
            link.fail(tid, f"the subscriber could not read this tap: {exc}")
            link.last_tid = max(link.last_tid, tid)
