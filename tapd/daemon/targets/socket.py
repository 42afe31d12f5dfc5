"""A subscriber process over a socket: a window of taps in flight, small taps sent in
batches to those that take them, and a last-heard time by which a silent one expires.
A worker pool's members are these too, fed by their pool (tapd/daemon/targets/pool.py).
"""

from __future__ import annotations

from typing import Any

from tapd.daemon.deliveries import Delivery, PeerKey, Send
from tapd.daemon.runs import TapRun
from tapd.daemon.subscriptions import Hello
from tapd.daemon.targets.base import Terms
from tapd.daemon.targets.peer import Peer
from tapd.protocol import MAGIC
from tapd.protocol.batch import encode_batch
from tapd.protocol.rules import DEFAULT_LIMITS
from tapd.protocol.wire import encode_header

# Taps up to this size go to subscribers in batches (and runs of ring taps always do),
# up to MESSAGE_BYTES of taps per message: the per-message costs (a header, a send, a
# receive, an ack) are paid once for all of them. Larger taps go one per `tap` message.
BATCH_BYTES = 64 * 1024
MESSAGE_BYTES = 1024 * 1024
BATCH_HEADER_BYTES = DEFAULT_LIMITS.max_header_bytes // 4  # well within what decoders take


class SocketSubscriber(Peer):
    def __init__(self, key: PeerKey, hello: Hello, terms: Terms, now: float) -> None:
        super().__init__(key, hello.name or repr(key), hello.subscription, terms)
        self.last_seen = now
        self.window = hello.window
        self.batch = hello.batch  # takes `taps` messages (several small taps in one)
        self.columns = hello.batch and hello.columns  # ... and decodes columnar runs
        self.group = hello.group  # the worker pool it is a member of, by name

    def same_subscription(self, hello: Hello) -> bool:
        """Whether `hello` asks for what it has already (its fallback patterns aside)."""
        mine, asked = self.subscription, hello.subscription
        return (
            mine.patterns == asked.patterns
            and mine.every == asked.every
            and mine.fallback_for == asked.fallback_for
            and self.group == hello.group
        )

    @property
    def send(self) -> Send:
        return self.ledger.send

    def run_limit(self) -> int:
        # (1 where it does not batch: its window counts one-tap messages)
        return max(1, self.window // 2) if self.batch else 1

    def send_next(self) -> bool:
        """Send the next queued unit, or the next small ones together as one `taps`
        message; False if the subscriber is unreachable."""
        queue = self.queue
        if not (self.batch and _batched(queue[0])):
            return self._send_each(self.start_delivery())
        # Up to half a window per message, so that the subscriber's ack of one batch
        # overlaps its work on the next.
        room = self.window - self.in_flight_taps
        limit = min(room, max(1, self.window // 2), DEFAULT_LIMITS.max_batch)
        deliveries = [self.start_delivery()]
        taps, size = deliveries[0].count, deliveries[0].nbytes
        # (a subscriber that decodes columnar runs gets runs and single taps in separate
        # messages: a message holds one or the other, encode_batch)
        run = self.columns and isinstance(deliveries[0].tap, TapRun)
        while (
            queue
            and taps + queue[0].count <= limit
            and size + queue[0].nbytes <= MESSAGE_BYTES
            and _batched(queue[0])
            and (not self.columns or isinstance(queue[0].tap, TapRun) == run)
        ):
            deliveries.append(self.start_delivery())
            taps += deliveries[-1].count
            size += deliveries[-1].nbytes
        frames = encode_batch([d.batch_piece() for d in deliveries], columns=self.columns)
        if len(frames[1]) <= BATCH_HEADER_BYTES or taps == 1:
            return self.send(self.key, frames)
        # Many distinct, large headers (rare): a batch could exceed what a subscriber
        # accepts, so these go one by one.
        return all(self._send_each(d) for d in deliveries)

    def _send_each(self, delivery: Delivery) -> bool:
        """The delivery's taps as `tap` messages, one each."""
        name = delivery.emitter_name
        for i, tap in enumerate(delivery.taps()):
            header = {**tap.header, "tid": delivery.tid + i, "emitter": name}
            if not self.send(self.key, [MAGIC, encode_header(header), *tap.frames]):
                return False
        return True

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "group": self.group}


def _batched(delivery: Delivery) -> bool:
    """Whether a subscriber that batches gets this unit in a `taps` message: small taps,
    and runs of them (a run of larger ring taps goes a `tap` message each, uncopied)."""
    return delivery.nbytes <= BATCH_BYTES * delivery.count
