"""The handlers of one subscriber, and running them on the taps a daemon sent.

Handlers run one at a time, in arrival order per daemon, on the thread that called
`Subscriber.run()`. A handler is registered for a consumer's name, or for a `prefix*`
pattern; a *batch* handler (`on(name, batch=True)`, or a handler object whose class
says `takes_batch = True`) is called once per site per received message, with a
`TapBatch` of that site's taps in it: the leaves stacked, the meta as columns, in seq
order. It runs where the site's first tap is in the message, so its taps may be handled
before other consumers' taps that arrived between them. It costs far less per tap than
a per-tap handler (bench/RESULTS.md, section 2), so sinks and recorders use it.

A handler that raises is logged here, and its text goes back to the daemon with the
ack (`DaemonLink.fail`), so that the emitter's `barrier_wait()` raises it.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Sequence
from typing import Any, cast

from tapd.consumers import first_match
from tapd.errors import TapdError, failure_text
from tapd.protocol import Message
from tapd.protocol.batch import SiteRun
from tapd_client.batch import TapBatch, batch_of_runs, batch_of_tap, last_tid, single_value
from tapd_client.daemon_link import ERROR_CHARS, DaemonLink
from tapd_client.meta import ColumnMeta, Columns, MetaTemplate, TapMeta
from tapd_client.sampling import Sampling

logger = logging.getLogger("tapd.subscriber")

Handler = Callable[[Any, TapMeta], object]
BatchHandler = Callable[[TapBatch], object]


class Handlers:
    """What a subscriber runs for each consumer, and the counts of what it ran."""

    def __init__(self) -> None:
        self.by_pattern: dict[str, Handler | BatchHandler] = {}
        self.batch: set[str] = set()  # consumers whose handlers take TapBatches
        self.fallback: set[str] = set()  # consumers whose handlers are fallbacks
        self.every = Sampling()  # consumers whose handlers sample: `every`
        self.processed = 0
        self.failed = 0

    def add(
        self,
        consumer: str,
        handler: Handler | BatchHandler,
        fallback: bool,
        batch: bool | None,
        every: int,
        fallback_for: str | None,
    ) -> None:
        """`fallback`: for the taps of the emitter `fallback_for` no one else takes."""
        if consumer in self.by_pattern:
            raise ValueError(f"consumer {consumer!r} already has a handler")
        self.every.add(consumer, every)
        if fallback and fallback_for is None:
            raise ValueError("a fallback handler needs Subscriber(fallback_for=...)")
        self.by_pattern[consumer] = handler
        if getattr(handler, "takes_batch", False) if batch is None else batch:
            self.batch.add(consumer)
        if fallback:
            self.fallback.add(consumer)

    def expire(self) -> None:
        """Let the handlers that keep state by time act on it (e.g. an Assembler
        reports its stale steps)."""
        for handler in self.by_pattern.values():
            expire = getattr(handler, "expire", None)
            if callable(expire):
                expire()

    def pattern_for(self, consumer: str) -> str | None:
        """The registered name (exact, else a `prefix*` pattern) that takes `consumer`."""
        handlers = self.by_pattern
        return consumer if consumer in handlers else first_match(handlers, consumer)

    # ---- running them -------------------------------------------------------------

    def handle_taps(self, link: DaemonLink, runs: Sequence[SiteRun]) -> None:
        """A `taps` message's taps, in order; a batch handler gets all the taps of one
        site in the message as one batch, where the site's first tap is."""
        templates: dict[int, MetaTemplate | None] = {}  # by static entry, for this message
        batched: set[int] = set()  # static entries whose batch has run
        for i, run in enumerate(runs):
            key = id(run.static)
            if key not in templates:
                try:
                    templates[key] = MetaTemplate(run.header(0))
                except Exception:  # odd metadata: reported per tap, or per batch
                    templates[key] = None
            pattern = self.pattern_for(run.fields["consumer"])
            if pattern not in self.batch:
                self._run_handlers(link, run, pattern, templates[key])
            elif key not in batched:
                batched.add(key)
                same_site = [r for r in runs[i:] if r.static is run.static]
                self._run_batch(link, same_site, pattern, templates[key])

    def run_handler(
        self,
        link: DaemonLink,
        message: Message,
        template: MetaTemplate | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Run the tap's handler; `check`, after it returns, says whether what it read
        was intact (views of a ring): a tap that fails it is one failure, reported once."""
        header = message.header
        tid = header.get("tid")
        if not isinstance(tid, int):
            logger.error("tap from the daemon at %s without a delivery id; ignored", link.endpoint)
            return
        link.last_tid = max(link.last_tid, tid)  # (a batch may have handled later ones)
        consumer = header["consumer"]
        pattern = self.pattern_for(consumer)
        if pattern in self.batch:
            self._run_batch(link, message, pattern, template)
            return
        if pattern is not None and not self.every.keeps(pattern, header):
            return  # sampled out: the daemon thins these, save a run it routed whole
        handler = None if pattern is None else cast(Handler, self.by_pattern[pattern])
        try:
            if handler is None:
                raise TapdError(f"no handler here for consumer {consumer!r}")
            meta = TapMeta.from_header(header) if template is None else template.meta(header)
            handler(message.value(), meta)
            if check is not None:
                check()
            self.processed += 1
        except Exception as exc:
            self._failed(link, handler, tid, consumer, header["seq"], exc)

    def _run_handlers(
        self, link: DaemonLink, run: SiteRun, pattern: str | None, template: MetaTemplate | None
    ) -> None:
        """A per-tap handler on each tap of a run, in order: what `run_handler` does per
        tap, with what the run's taps share made once (the small-tap hot path): the
        values are rows of the run's stacked leaves (views of its body), the metas
        `ColumnMeta`s reading the run's columns, each a small object made per tap."""
        values = None
        if pattern is not None and template is not None:
            try:
                values = run.values() if len(run) > 1 else [single_value(run)]
            except Exception:  # (odd leaves: each tap reports its own error below)
                pass
        if pattern is None or template is None or values is None:
            for tap in range(len(run)):  # each tap fails on its own, as it says
                self.run_handler(link, run.message(tap), template)
            return
        handler = cast(Handler, self.by_pattern[pattern])
        columns = Columns(template, [run])
        link.last_tid = max(link.last_tid, run.last_tid)
        every = self.every.modulus(pattern, run.fields)
        taps: Sequence[int] = range(len(values))
        if every > 1:  # sampled out (see `run_handler`)
            taps = [i for i, seq in enumerate(columns.seqs) if not seq % every]
        new: Callable[[type[ColumnMeta]], Any] = object.__new__
        column_meta = ColumnMeta
        processed = 0
        try:
            for i in taps:
                meta = new(column_meta)
                meta._columns = columns
                meta._index = i
                try:
                    handler(values[i], meta)
                    processed += 1
                except Exception as exc:
                    self._failed(link, handler, columns.tids[i], template.consumer, meta.seq, exc)
        finally:
            self.processed += processed

    def _failed(
        self, link: DaemonLink, handler: Any, tid: int, consumer: str, seq: Any, exc: Exception
    ) -> None:
        """A handler raised: logged here, and its text goes back with the ack."""
        self.failed += 1
        name = getattr(handler, "__qualname__", repr(handler))
        logger.error(
            "handler %s for %r (seq %s) raised:\n%s",
            name,
            consumer,
            seq,
            traceback.format_exc(),
        )
        link.fail(tid, failure_text(name, exc, ERROR_CHARS))  # with its traceback

    def _run_batch(
        self,
        link: DaemonLink,
        taps: Sequence[SiteRun] | Message,
        pattern: str,
        template: MetaTemplate | None,
    ) -> None:
        """Run a batch handler on runs of one static entry (or on one `tap` message)."""
        if isinstance(taps, Message):
            count, header = 1, taps.header
            link.last_tid = max(link.last_tid, header["tid"])
        else:
            count, header = sum(map(len, taps)), taps[0].header(0)
            link.last_tid = max(link.last_tid, last_tid(taps))
        handler = cast(BatchHandler, self.by_pattern[pattern])
        try:
            if template is None:
                template = MetaTemplate(header)  # (raises what made it None)
            batch = (
                batch_of_tap(taps, template)
                if isinstance(taps, Message)
                else batch_of_runs(taps, template)
            )
            handler(batch)
            self.processed += count
        except Exception as exc:
            self.failed += count
            tids = (
                [header["tid"]]
                if isinstance(taps, Message)
                else [tid for run in taps for tid in run.column_lists()[0]]
            )
            name = getattr(handler, "__qualname__", repr(handler))
            logger.error(
                "batch handler %s for %r (%d taps from seq %s) raised:\n%s",
                name,
                header["consumer"],
                count,
                header["seq"],
                traceback.format_exc(),
            )
            text = failure_text(name, exc, ERROR_CHARS)
            for tid in tids:
                link.fail(tid, text)
