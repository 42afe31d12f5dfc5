"""Forwarding to an upstream daemon (`tapd start --forward ENDPOINT`).

The forwarder faces two ways, each speaking a role the protocol already has:
- inside this daemon it is a subscriber of every consumer (`*`), fed by the router like
  any other, with the same byte bound on its queue and the same policy when it is full;
- towards the upstream daemon it is an emitter: `hello` with role `emitter`, taps only
  while the upstream's credit window allows, and a `barrier` behind every batch.

A tap stays in flight at this daemon's router until the upstream answers a barrier sent
after it, that is until every upstream subscriber it was routed to has processed it (or
the upstream dropped it, or had no subscriber for it: counted there and here). Only then
is it acknowledged here. So an emitter's `barrier_wait()` through a forwarder returns
once the upstream has finished its taps, and handler errors upstream surface there; and
an upstream that is slow, full or not up yet holds taps back in this daemon's forwarder
queue, whose bound and policy (`block`: the emitters slow down; `drop_newest`: counted
drops) apply as to any subscriber. An upstream that restarts is sent again every tap it
had not confirmed: at least once, so a tap may arrive twice, with the same `seq`.

Taps go upstream with the header they came with, every field kept, known or not, plus
`emitter`: the original emitter's "host:pid", which the upstream gives its subscribers
in place of the forwarder's name (docs/PROTOCOL.md, "Forwarding").
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import os
import socket
import time
from typing import Any

import zmq

from tapd.clients import emitter_socket
from tapd.clients.emitter_socket import EmitterSocket
from tapd.config import Config
from tapd.daemon.bounds import bound_upstream
from tapd.daemon.router import Router
from tapd.daemon.wants import parse_wants
from tapd.errors import ConfigError, ProtocolError
from tapd.protocol import MAGIC, Limits, Message
from tapd.protocol.link import (
    Looped,
    Refused,
    Restarted,
    Welcomed,
    parse_outcome_ranges,
)
from tapd.protocol.wire import encode_header
from tapd.runtime import check_endpoint_dir
from tapd.security import ClientKeys

logger = logging.getLogger("tapd.daemon")

# Silent with taps outstanding: say hello again (the link's timer) and repeat the last
# barrier, in case the connection dropped and took the upstream's answers with it. The
# wait doubles while the upstream stays silent (it may be down for long: hellos queue up).
_REHELLO_AFTER_MAX = 60.0
# Silent this long with taps waiting: warn (again after as long once more).
_WARN_AFTER = 10.0
# A tap that the upstream has not received after this many sends, although it answered
# the barriers behind each, is given up as lost (it refuses it, e.g. as too large).
_MAX_SENDS = 3
_MAX_BATCH = 4096  # taps between two barriers: bounds the outcomes in a barrier_done
_KEEP_ALIVE = 1.0  # idle this long (nothing sent or heard): an empty barrier


@dataclasses.dataclass
class _Forwarded:
    tid: int  # the router's delivery id here; also the tap's `fid` upstream
    frames: list[Any]  # [MAGIC, header, *arrays]: ready to send, or send again
    nbytes: int
    origin: tuple[Any, ...]  # (emitter, device, consumer, seq): matches upstream errors
    error: str | None = None
    outcome: str | None = None  # delivered, dropped, unrouted (upstream), or lost
    sends: int = 0  # to the current upstream daemon


class Forwarder:
    """The link from this daemon's router to the upstream daemon at `config.forward`."""

    def __init__(
        self, context: zmq.Context[Any], config: Config, router: Router, daemon_id: str
    ) -> None:
        assert config.forward is not None
        self.endpoint = config.forward
        self.router = router
        self.daemon_id = daemon_id
        self.key = ("forward", self.endpoint)  # never a socket peer's (index, identity)
        self.name = f"forward to {self.endpoint}"
        self.limits = Limits(max_message_bytes=config.max_message_bytes)
        check_endpoint_dir(self.endpoint)  # an ipc upstream in a squatted dir gets nothing
        keys = None
        if self.endpoint.startswith("tcp://") and not config.insecure:
            assert config.forward_server_key and config.curve_secret_key
            keys = ClientKeys.from_files(config.forward_server_key, config.curve_secret_key)
        try:
            # One identity for this daemon's lifetime, so that after a reconnection the
            # upstream still knows us (it keys its emitters by identity, and lets a new
            # connection take the identity over from a dead one); a tcp:// connection
            # that died unseen is found and made again (tapd/protocol/link.py).
            self.socket = emitter_socket.connect(
                context,
                self.endpoint,
                secure=functools.partial(_prepare_upstream, keys=keys, limits=self.limits),
                routing_id=f"tapd-forward:{daemon_id}".encode(),
            )
        except zmq.ZMQError as exc:
            raise ConfigError(f"--forward {self.endpoint}: cannot connect: {exc}") from exc
        identity = {
            "role": "emitter",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "forwarder": daemon_id,
        }
        now = time.monotonic()
        # hello/welcome, the upstream's credit window, rehello: as any emitter's
        self.connection = EmitterSocket(
            self.socket,
            identity,
            now,
            rehello_max=_REHELLO_AFTER_MAX,
            self_id=daemon_id,
            limits=self.limits,
        )
        self.link = self.connection.link
        self.outbox: collections.deque[_Forwarded] = collections.deque()  # not sent yet
        self.outbox_bytes = 0
        # Sent, waiting for the barrier that follows them: (barrier id, taps).
        self.unconfirmed: collections.deque[tuple[int, list[_Forwarded]]] = collections.deque()
        self._sent: dict[int, _Forwarded] = {}  # the taps in `unconfirmed`, by fid
        # Every tap taken from the router and not yet acknowledged to it, in tid order:
        # acknowledgements go in that order, so a tap sent again holds back later ones.
        self._held: dict[int, _Forwarded] = {}
        self._barrier_ids = itertools.count()
        self._last_warning = self._last_sent = now
        router.subscribers.add_local(self.key, self.name, ["*"], self._take)
        what = "with CurveZMQ" if keys else "unauthenticated" if config.insecure else "over ipc"
        logger.info("forwarding every tap to %s (%s)", self.endpoint, what)

    # ---- from the router --------------------------------------------------------------

    def _take(self, tid: int, tap: Message, emitter: str, nbytes: int) -> None:
        # This hop's delivery id goes upstream as the tap's `fid`, by which the upstream
        # says what became of it.
        header = {**tap.header, "emitter": emitter, "fid": tid}
        header.pop("tid", None)
        origin = (emitter, header.get("device"), header["consumer"], header["seq"])
        frames = [MAGIC, encode_header(header), *tap.frames]
        item = _Forwarded(tid, frames, nbytes, origin)
        self.outbox.append(item)
        self.outbox_bytes += nbytes
        self._held[tid] = item

    # ---- the daemon's loop ------------------------------------------------------------

    def flush(self, now: float) -> None:
        """Send what the upstream's credit allows, then a barrier behind it."""
        if self.key not in self.router.subscribers.peers:
            return  # stopped: forwarding to ourselves, or shut down
        link = self.link
        batch: list[_Forwarded] = []
        while self.outbox and link.may_send(self.outbox[0].nbytes):
            item = self.outbox.popleft()
            self.outbox_bytes -= item.nbytes
            self.connection.send(item.frames, item.nbytes)
            item.sends += 1
            self._sent[item.tid] = item
            batch.append(item)
            if len(batch) == _MAX_BATCH or not self.outbox:
                self._barrier(batch)
                batch = []
        if batch:
            self._barrier(batch)
        if (
            link.window
            and not self.unconfirmed
            and now - max(link.last_heard, self._last_sent) > _KEEP_ALIVE
        ):
            # Idle: an empty barrier tells the upstream we live (it forgets forwarders
            # silent too long) and, answered, that it does.
            self._barrier([])
        if not (self.unconfirmed or link.in_flight or self.outbox):
            return
        if self.connection.tick(now, waiting=True) and self.unconfirmed:
            self.connection.resend_barriers(last_only=True)
        if now - max(link.last_heard, self._last_warning) > _WARN_AFTER:
            self._last_warning = now
            logger.warning(
                "no answer from the upstream daemon at %s for %.0f s; %d taps sent to it and "
                "not confirmed, %d more wait here (%d bytes in all). Is it running, and does "
                "it admit this daemon's key?",
                self.endpoint,
                now - link.last_heard,
                len(self._sent),
                len(self.outbox),
                sum(item.nbytes for item in self._held.values()),
            )

    def _barrier(self, batch: list[_Forwarded]) -> None:
        barrier = next(self._barrier_ids)
        self.connection.send_barrier(barrier)
        self._last_sent = time.monotonic()
        self.unconfirmed.append((barrier, batch))
        self.router.ledger.count("forward_sent", len(batch))

    def _malformed(self, exc: ProtocolError) -> None:
        self.router.reject(exc.reason, f"from the upstream at {self.endpoint}: {exc}")

    def receive(self, now: float) -> None:
        for message, event in self.connection.receive(now, self._malformed):
            header = message.header
            kind = message.kind
            if event is None:
                if kind == "barrier_done":
                    self._confirmed(header, now)
                elif kind == "error":
                    self._error(header)
                elif kind == "wants":  # what the upstream's takers want: wakes sites here
                    self.router.set_wanted(self.key, parse_wants(header))
                else:
                    self.router.reject(
                        "bad_header", f"{kind!r} from the upstream at {self.endpoint}"
                    )
            elif isinstance(event, Refused):
                self.router.reject(
                    event.reason, f"from the upstream at {self.endpoint}: {event.detail}"
                )
            elif isinstance(event, Welcomed) and event.first:
                logger.info("upstream daemon %s at %s welcomed us", event.daemon, self.endpoint)
            elif isinstance(event, Restarted):
                self.router.set_wanted(self.key, None)  # everything, until the new one says
                self._restarted(event)
            elif isinstance(event, Looped):
                self._looped()
            # Credited, RehelloAsked: the link has done all there is to do

    # ---- from the upstream ------------------------------------------------------------

    def _looped(self) -> None:
        logger.error("--forward %s leads back to this daemon: forwarding nothing", self.endpoint)
        self.router.subscribers.drop(self.key, "would forward to itself")
        self.outbox.clear()
        self.unconfirmed.clear()
        self._sent.clear()
        self._held.clear()
        self.outbox_bytes = 0

    def _restarted(self, event: Restarted) -> None:
        """A new upstream daemon: what the old one had not confirmed may be lost with
        it. Send it all again, once the new one has answered our hello (the link has
        closed the window and said it)."""
        again = self._take_back_unconfirmed()
        for item in again:
            item.sends = 0
        self._send_again(again)
        self._acknowledge(time.monotonic())  # those whose outcome came before the restart
        logger.warning(
            "the upstream daemon at %s restarted (now %s); sending again the %d taps "
            "it had not confirmed (they may arrive twice, with the same seq)",
            self.endpoint,
            event.daemon,
            len(again),
        )

    def _take_back_unconfirmed(self) -> list[_Forwarded]:
        again = [item for _, batch in self.unconfirmed for item in batch if item.outcome is None]
        self.unconfirmed.clear()
        self._sent.clear()
        return again

    def _send_again(self, again: list[_Forwarded]) -> None:
        """Back into the outbox, in tid order (the order they came in) with what waits."""
        if not again:
            return
        self.outbox = collections.deque(sorted([*again, *self.outbox], key=lambda i: i.tid))
        self.outbox_bytes += sum(item.nbytes for item in again)
        self.router.ledger.count("forward_resent", len(again))

    def _confirmed(self, header: dict[str, Any], now: float) -> None:
        """The upstream finished every tap it received before barrier `id`, and says
        what became of each (`outcomes`). A tap sent before that barrier without an
        outcome never reached it: lost on the way (a connection dropped); it is sent
        again, up to _MAX_SENDS times, then counted lost."""
        ranges = parse_outcome_ranges(header.get("outcomes", []))
        legacy = "outcomes" not in header  # an upstream that does not say: all delivered
        self._apply_outcomes(ranges)
        done: list[_Forwarded] = []
        while self.unconfirmed and self.unconfirmed[0][0] <= header["id"]:
            done.extend(self.unconfirmed.popleft()[1])
        again = []
        for item in done:
            if self._sent.get(item.tid) is item:
                del self._sent[item.tid]
            if item.outcome is not None:
                continue
            if legacy:
                item.outcome = "delivered"
            elif item.sends < _MAX_SENDS:
                again.append(item)
            else:
                item.outcome = "lost"
                self._count("lost", 1)
        if again:
            logger.warning(
                "%d taps sent to the upstream daemon at %s never reached it (a connection "
                "dropped?); sending them again",
                len(again),
                self.endpoint,
            )
            self._send_again(again)
        self._acknowledge(now)

    def _apply_outcomes(self, ranges: list[tuple[int, int, str]]) -> None:
        sent = self._sent
        for first, last, outcome in ranges:
            if last - first < len(sent):
                items = [sent[fid] for fid in range(first, last + 1) if fid in sent]
            else:
                items = [item for fid, item in sent.items() if first <= fid <= last]
            for item in items:
                if item.outcome is None:
                    item.outcome = outcome
                    self._count(outcome, 1)

    def _count(self, outcome: str, taps: int) -> None:
        """Counters for what became of forwarded taps; the first drop, loss and unrouted
        tap are logged as well."""
        counter = "forward_lost" if outcome == "lost" else f"forward_upstream_{outcome}"
        if outcome != "delivered" and not self.router.counters[counter]:
            what = {
                "dropped": "dropped",
                "unrouted": "had no subscriber for",
                "lost": f"never received (after {_MAX_SENDS} sends)",
            }[outcome]
            logger.warning(
                "the upstream daemon at %s %s forwarded taps; further ones are counted "
                "in %s, not logged (the emitters' barriers count them as %s)",
                self.endpoint,
                what,
                counter,
                "unrouted" if outcome == "unrouted" else "dropped",
            )
        self.router.ledger.count(counter, taps)
        if outcome != "lost":
            self.router.ledger.count("forward_confirmed", taps)

    def _acknowledge(self, now: float) -> None:
        """Acknowledge to the router, in tid order, every tap whose fate is known; with
        handler errors, and which ones the upstream dropped or had no subscriber for."""
        if self.key not in self.router.subscribers.peers:
            return
        held = self._held
        finished = []
        for item in held.values():
            if item.outcome is None:
                break
            finished.append(item)
        if not finished:
            return
        for item in finished:
            del held[item.tid]
        self.router.subscribers.ack(
            self.key,
            {
                "upto": finished[-1].tid,
                "errors": [
                    {"tid": item.tid, "error": item.error} for item in finished if item.error
                ],
                "dropped": {item.tid for item in finished if item.outcome in ("dropped", "lost")},
                "unrouted": {item.tid for item in finished if item.outcome == "unrouted"},
            },
            now,
        )

    def _error(self, header: dict[str, Any]) -> None:
        """A handler upstream raised: attach the error to our tap, so that the ack
        here carries it on to the emitter's barrier_wait(). Where the upstream is named
        goes on the error's first line, so that its traceback still ends the text."""
        first, newline, formatted = header["error"].partition("\n")
        where = f"(in subscriber {header['subscriber']} at {self.endpoint})"
        text = f"{first} {where}{newline}{formatted}"
        wanted = (header.get("emitter"), header.get("device"), header["consumer"], header["seq"])
        for item in self._sent.values():
            # An upstream that does not name the emitter is matched by name and seq.
            if item.error is None and (
                item.origin == wanted or ("emitter" not in header and item.origin[2:] == wanted[2:])
            ):
                item.error = text
                return
        logger.error("tap function raised upstream for a tap no longer held here: %s", text)

    # ---- reporting and shutdown -------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "upstream": self.link.daemon,
            "window_bytes": self.link.window,
            "in_flight_bytes": self.link.in_flight,
            "waiting": len(self.outbox),
            "waiting_bytes": self.outbox_bytes,
            "unconfirmed": len(self._sent),
            "held": len(self._held),
            "silent_s": round(time.monotonic() - self.link.last_heard, 3),
            "upstream_wants": self._upstream_wants(),
        }

    def _upstream_wants(self) -> str | list[list[Any]]:
        """What the upstream said its takers want ("everything" until it says)."""
        target = self.router.subscribers.peers.get(self.key)
        wanted = None if target is None else target.subscription.wanted
        return "everything" if wanted is None else [list(pair) for pair in wanted]

    def close(self) -> None:
        unsent = len(self._held)
        if unsent:
            logger.error(
                "%d taps for the upstream daemon at %s were not confirmed by it at shutdown "
                "(counted lost); %s",
                unsent,
                self.endpoint,
                "it never answered" if self.link.daemon is None else f"it is {self.link.daemon}",
            )
        self.connection.bye()
        # Taps counted lost are not sent on after all; otherwise a bounded linger.
        self.connection.channel.close(linger=0 if unsent else 1000)


def _prepare_upstream(sock: zmq.Socket[Any], *, keys: ClientKeys | None, limits: Limits) -> None:
    """Before the forwarder's socket connects: only headers come back from upstream,
    so it takes header-sized frames; and the keys of a tcp:// upstream."""
    bound_upstream(sock, limits)
    if keys is not None:
        keys.apply(sock)
