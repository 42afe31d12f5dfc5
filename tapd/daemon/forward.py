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
import itertools
import logging
import os
import socket
import time
from typing import Any

import zmq

from tapd.config import Config
from tapd.daemon.router import Router
from tapd.errors import ConfigError, ProtocolError
from tapd.protocol import MAGIC, Limits, Message, decode, encode
from tapd.protocol.link import EmitterLink, Looped, Refused, Restarted, Welcomed
from tapd.protocol.wire import encode_header
from tapd.security import ClientKeys

logger = logging.getLogger("tapd.daemon")

# Silent with taps outstanding: say hello again (the link's timer) and repeat the last
# barrier, in case the connection dropped and took the upstream's answers with it. The
# wait doubles while the upstream stays silent (it may be down for long: hellos queue up).
_REHELLO_AFTER_MAX = 60.0
# Silent this long with taps waiting: warn (again after as long once more).
_WARN_AFTER = 10.0


@dataclasses.dataclass
class _Forwarded:
    tid: int  # the router's delivery id here
    frames: list[Any]  # [MAGIC, header, *arrays]: ready to send, or send again
    nbytes: int
    origin: tuple[Any, ...]  # (emitter, device, consumer, seq): matches upstream errors
    error: str | None = None


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
        keys = None
        if self.endpoint.startswith("tcp://") and not config.insecure:
            assert config.forward_server_key and config.curve_secret_key
            keys = ClientKeys.from_files(config.forward_server_key, config.curve_secret_key)
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # bounded by the upstream's credit window
        self.socket.setsockopt(zmq.RCVHWM, 0)
        # One identity for this daemon's lifetime, so that after a reconnection the
        # upstream still knows us (it keys its emitters by identity).
        self.socket.setsockopt(zmq.ROUTING_ID, f"tapd-forward:{daemon_id}".encode())
        if keys is not None:
            keys.apply(self.socket)
        try:
            self.socket.connect(self.endpoint)
        except zmq.ZMQError as exc:
            self.socket.close(linger=0)
            raise ConfigError(f"--forward {self.endpoint}: cannot connect: {exc}") from exc
        identity = {"role": "emitter", "host": socket.gethostname(), "pid": os.getpid(),
                    "forwarder": daemon_id}  # fmt: skip
        now = time.monotonic()
        # hello/welcome, the upstream's credit window, rehello: as any emitter's
        self.link = EmitterLink(identity, now, rehello_max=_REHELLO_AFTER_MAX, self_id=daemon_id)
        self.outbox: collections.deque[_Forwarded] = collections.deque()  # not sent yet
        self.outbox_bytes = 0
        # Sent, waiting for the barrier that follows them: (barrier id, taps).
        self.unconfirmed: collections.deque[tuple[int, list[_Forwarded]]] = collections.deque()
        self._barrier_ids = itertools.count()
        self._totals = (0, 0, 0)  # upstream's (delivered, dropped, unrouted) for us so far
        self._confirmed_taps = 0  # taps its barriers confirmed, since it welcomed us
        self._lost_taps = 0  # of those, taps its totals show it never received
        self._last_warning = now
        router.add_local_subscriber(self.key, self.name, ["*"], self._take, now)
        self._send_link()
        what = "with CurveZMQ" if keys else "unauthenticated" if config.insecure else "over ipc"
        logger.info("forwarding every tap to %s (%s)", self.endpoint, what)

    # ---- from the router --------------------------------------------------------------

    def _take(self, tid: int, tap: Message, emitter: str, nbytes: int) -> None:
        header = {**tap.header, "emitter": emitter}
        header.pop("tid", None)  # this hop's delivery id means nothing upstream
        origin = (emitter, header.get("device"), header["consumer"], header["seq"])
        frames = [MAGIC, encode_header(header), *tap.frames]
        self.outbox.append(_Forwarded(tid, frames, nbytes, origin))
        self.outbox_bytes += nbytes

    # ---- the daemon's loop ------------------------------------------------------------

    def flush(self, now: float) -> None:
        """Send what the upstream's credit allows, then a barrier behind it."""
        if self.key not in self.router.subscribers:
            return  # stopped: forwarding to ourselves, or shut down
        link = self.link
        batch = []
        while self.outbox and link.may_send(self.outbox[0].nbytes):
            item = self.outbox.popleft()
            self.outbox_bytes -= item.nbytes
            self.socket.send_multipart(item.frames, copy=False)
            link.sent(item.nbytes)
            batch.append(item)
        if batch:
            barrier = next(self._barrier_ids)
            self.socket.send_multipart(encode("barrier", {"id": barrier}))
            self.unconfirmed.append((barrier, batch))
            self.router.counters["forward_sent"] += len(batch)
        if not (self.unconfirmed or link.in_flight or self.outbox):
            return
        if link.tick(now, waiting=True):
            self._send_link()
            if self.unconfirmed:
                last = self.unconfirmed[-1][0]
                self.socket.send_multipart(encode("barrier", {"id": last}))
        if now - max(link.last_heard, self._last_warning) > _WARN_AFTER:
            self._last_warning = now
            logger.warning(
                "no answer from the upstream daemon at %s for %.0f s; %d taps (%d bytes) wait "
                "here for it. Is it running, and does it admit this daemon's key?",
                self.endpoint, now - link.last_heard, len(self.outbox), self.outbox_bytes,
            )  # fmt: skip

    def _send_link(self) -> None:
        for frames in self.link.outgoing():
            self.socket.send_multipart(frames)

    def receive(self, now: float) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message = decode(frames, self.limits)
            except ProtocolError as exc:
                self.router.reject(exc.reason, f"from the upstream at {self.endpoint}: {exc}")
                continue
            header = message.header
            kind = message.kind
            event = self.link.received(header, now)
            self._send_link()
            if event is None:
                if kind == "barrier_done":
                    self._confirmed(header, now)
                elif kind == "error":
                    self._error(header)
                else:
                    self.router.reject("bad_header", f"{kind!r} from the upstream at "
                                       f"{self.endpoint}")  # fmt: skip
            elif isinstance(event, Refused):
                self.router.reject(event.reason, f"from the upstream at {self.endpoint}: "
                                   f"{event.detail}")  # fmt: skip
            elif isinstance(event, Welcomed) and event.first:
                logger.info("upstream daemon %s at %s welcomed us", event.daemon, self.endpoint)
            elif isinstance(event, Restarted):
                self._restarted(event)
            elif isinstance(event, Looped):
                self._looped()
            # Credited, RehelloAsked: the link has done all there is to do

    # ---- from the upstream ------------------------------------------------------------

    def _looped(self) -> None:
        logger.error("--forward %s leads back to this daemon: forwarding nothing",
                     self.endpoint)  # fmt: skip
        self.router.drop_subscriber(self.key, "would forward to itself")
        self.outbox.clear()
        self.unconfirmed.clear()
        self.outbox_bytes = 0

    def _restarted(self, event: Restarted) -> None:
        """A new upstream daemon: what the old one had not confirmed may be lost with
        it. Send it all again, once the new one has answered our hello (the link has
        closed the window and said it)."""
        again = [item for _, batch in self.unconfirmed for item in batch]
        self.unconfirmed.clear()
        self.outbox.extendleft(reversed(again))
        self.outbox_bytes += sum(item.nbytes for item in again)
        self.router.counters["forward_resent"] += len(again)
        logger.warning(
            "the upstream daemon at %s restarted (now %s); sending again the %d taps "
            "it had not confirmed (they may arrive twice, with the same seq)",
            self.endpoint, event.daemon, len(again),
        )  # fmt: skip
        self._totals = (0, 0, 0)
        self._confirmed_taps = self._lost_taps = 0

    def _confirmed(self, header: dict[str, Any], now: float) -> None:
        done: list[_Forwarded] = []
        while self.unconfirmed and self.unconfirmed[0][0] <= header["id"]:
            done.extend(self.unconfirmed.popleft()[1])
        self._count_upstream(header)
        if not done or self.key not in self.router.subscribers:
            return
        self._check_received(done)
        errors = [{"tid": item.tid, "error": item.error} for item in done if item.error]
        self.router.counters["forward_confirmed"] += len(done)
        self.router.ack(self.key, {"upto": done[-1].tid, "errors": errors}, now)

    def _check_received(self, done: list[_Forwarded]) -> None:
        """A barrier confirms every tap sent before it, but a connection that dropped
        and came back to the same upstream may have lost some on the way. The
        upstream's totals for us say how many it finished; any shortfall is reported
        as an error on the latest taps confirmed (which ones were lost is unknown)."""
        self._confirmed_taps += len(done)
        missing = self._confirmed_taps - sum(self._totals) - self._lost_taps
        if missing <= 0:
            return
        self._lost_taps += missing
        self.router.counters["forward_lost"] += missing
        text = (f"lost on the way to the upstream daemon at {self.endpoint}: it finished "
                f"{missing} fewer of these {len(done)} forwarded taps than were sent")  # fmt: skip
        logger.error("%s", text)
        for item in done[-missing:]:
            item.error = item.error or text

    def _count_upstream(self, header: dict[str, Any]) -> None:
        """The upstream's totals for us, as counters here; drops and taps nobody
        wanted there are logged (the first of each) as well."""
        totals = (header["delivered"], header["dropped"], header["unrouted"])
        names = ("delivered", "dropped", "unrouted")
        for name, new, old in zip(names, totals, self._totals, strict=True):
            if new > old:
                counter = f"forward_upstream_{name}"
                if name != "delivered" and not self.router.counters[counter]:
                    logger.warning(
                        "the upstream daemon at %s %s forwarded taps (%d so far; "
                        "further ones counted in forward_upstream_%s, not logged)",
                        self.endpoint,
                        "dropped" if name == "dropped" else "had no subscriber for",
                        new - old,
                        name,
                    )
                self.router.counters[counter] += new - old
        self._totals = totals

    def _error(self, header: dict[str, Any]) -> None:
        """A handler upstream raised: attach the error to our tap, so that the ack
        here carries it on to the emitter's barrier_wait()."""
        text = f"{header['error']} (in subscriber {header['subscriber']} at {self.endpoint})"
        wanted = (header.get("emitter"), header.get("device"), header["consumer"], header["seq"])
        for _, batch in self.unconfirmed:
            for item in batch:
                # An upstream that does not name the emitter is matched by name and seq.
                if item.error is None and (
                    item.origin == wanted
                    or ("emitter" not in header and item.origin[2:] == wanted[2:])
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
            "unconfirmed": sum(len(batch) for _, batch in self.unconfirmed),
        }

    def close(self) -> None:
        unsent = len(self.outbox) + sum(len(batch) for _, batch in self.unconfirmed)
        if unsent:
            logger.error(
                "%d taps for the upstream daemon at %s were not confirmed by it at shutdown "
                "(counted lost); %s",
                unsent,
                self.endpoint,
                "it never answered" if self.link.daemon is None else f"it is {self.link.daemon}",
            )
        try:
            self.socket.send_multipart(encode("bye", {}), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        # Taps counted lost are not sent on after all; otherwise a bounded linger.
        self.socket.close(linger=0 if unsent else 1000)
