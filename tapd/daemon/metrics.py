"""`tapd start --metrics HOST:PORT`: the daemon's stats as Prometheus metrics.

The values are those of `tapd status --json`, read at scrape time: a custom collector
turns one stats snapshot into metric families. Names follow Prometheus conventions
(`tapd_` prefix, `_total` on counters, `_bytes` / `_seconds` units); labels are bounded
by peers (an emitter's `host:pid`, a subscriber's name and consumers, a ring's file
name, a rejection reason), never one per tap.

Threads: the daemon's loop is single-threaded and owns all routing state, while the
HTTP server answers on threads of its own. A scrape therefore never reads that state:
it asks the loop for a snapshot (`Snapshots.get`: a queued request and a wake-up of the
loop's poll) and waits for it; the loop builds the same dict the `stats` control
message returns, between two rounds of work, and hands it over. The values are exact at
that moment (a periodically published copy would be up to a period old), and the loop
pays only an emptiness check per round when nobody scrapes.
"""

from __future__ import annotations

import errno
import logging
import queue
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from tapd.config import metrics_address
from tapd.errors import ConfigError

logger = logging.getLogger("tapd.daemon")

Stats = dict[str, Any]
SCRAPE_TIMEOUT = 5.0  # seconds a scrape waits for the loop (which may be draining)

# The daemon-wide counters of `stats["counters"]`: metric name (without `_total`), help.
COUNTERS = {
    "taps_received": (
        "tapd_taps_received",
        "Taps received from emitters, over sockets and from shared-memory rings.",
    ),
    "bytes_received": ("tapd_received_bytes", "Bytes of array payload received from emitters."),
    "deliveries_acked": (
        "tapd_deliveries_handled",
        "Taps that subscribers acknowledged as handled, one per tap per subscriber.",
    ),
    "deliveries_dropped": (
        "tapd_deliveries_dropped",
        "Deliveries dropped because a subscriber's queue (or spool) was full (drop_newest).",
    ),
    "deliveries_lost": (
        "tapd_deliveries_lost",
        "Deliveries lost with a subscriber that "
        "went away, timed out or was still connected at shutdown.",
    ),
    "deliveries_resent": (
        "tapd_deliveries_resent",
        "Deliveries sent again to a subscriber that said hello again with taps in flight.",
    ),
    "taps_unrouted": ("tapd_taps_unrouted", "Taps that no subscriber wanted."),
    "taps_skipped": (
        "tapd_taps_skipped",
        "Taps that emitters did not copy: their site was dormant (no taker) or sampled out.",
    ),
    "taps_thinned": (
        "tapd_taps_thinned",
        "Taps that every subscriber of their consumer sampled out (every=): counted "
        "unrouted to the emitter.",
    ),
    "deliveries_thinned": (
        "tapd_deliveries_thinned",
        "Deliveries not made because the subscriber samples the consumer (every=).",
    ),
    "taps_refused": (
        "tapd_taps_refused",
        "Taps refused because they broke the protocol (the emitter is told; counted dropped).",
    ),
    "handler_errors": (
        "tapd_handler_errors",
        "Tap functions or handlers that raised, as reported by subscribers.",
    ),
    "taps_spooled": (
        "tapd_taps_spooled",
        "Taps written to a subscriber's on-disk spool (policy spool).",
    ),
    "taps_unspooled": (
        "tapd_taps_unspooled",
        "Taps read back from a spool into a subscriber's queue.",
    ),
    "spool_fallback_dropped": (
        "tapd_spool_fallback_dropped",
        "Taps dropped because a spool was full and the spool fallback is drop_newest.",
    ),
    "forward_sent": ("tapd_forward_sent", "Taps sent to the upstream daemon (--forward)."),
    "forward_resent": (
        "tapd_forward_resent",
        "Taps sent to the upstream daemon again, after it restarted or reconnected.",
    ),
    "forward_confirmed": (
        "tapd_forward_confirmed",
        "Forwarded taps whose outcome the upstream daemon reported.",
    ),
    "auth_refused": (
        "tapd_auth_refused",
        "Peers refused by CurveZMQ authentication on a tcp endpoint.",
    ),
}
REJECTED = "rejected_"  # counters rejected_<reason>: one labelled family

# Per emitter (label `emitter`, host:pid) and per subscriber (labels `subscriber`,
# `consumers`): stats field -> (metric name, counter?, help).
EMITTER_METRICS = {
    "taps": ("tapd_emitter_taps_received", True, "Taps received from this emitter."),
    "bytes": (
        "tapd_emitter_received_bytes",
        True,
        "Bytes of array payload received from this emitter.",
    ),
    "delivered": (
        "tapd_emitter_taps_delivered",
        True,
        "Taps of this emitter that every subscriber they were routed to handled.",
    ),
    "dropped": (
        "tapd_emitter_taps_dropped",
        True,
        "Taps of this emitter dropped or refused for at least one subscriber.",
    ),
    "unrouted": (
        "tapd_emitter_taps_unrouted",
        True,
        "Taps of this emitter that no subscriber wanted.",
    ),
    "pending": (
        "tapd_emitter_pending_units",
        False,
        "Taps (or runs of ring records) of "
        "this emitter not yet handled by every subscriber: what barriers wait for.",
    ),
    "parked_bytes": (
        "tapd_emitter_parked_bytes",
        False,
        "Bytes of this emitter's taps waiting for room in a subscriber queue (policy block).",
    ),
    "last_handled_time": (
        "tapd_emitter_last_handled_tap_timestamp_seconds",
        False,
        "Emitter time (meta.time, seconds since the epoch) of the newest "
        "tap of this emitter that a subscriber handled; lag is time() "
        "minus this. Absent until one was handled.",
    ),
}
SUBSCRIBER_METRICS = {
    "delivered": (
        "tapd_subscriber_taps_handled",
        True,
        "Taps this subscriber handled (acknowledged).",
    ),
    "delivered_bytes": (
        "tapd_subscriber_handled_bytes",
        True,
        "Bytes of array payload this subscriber handled (acknowledged).",
    ),
    "dropped": (
        "tapd_subscriber_taps_dropped",
        True,
        "Taps for this subscriber dropped because its queue was full.",
    ),
    "errors": (
        "tapd_subscriber_handler_errors",
        True,
        "Handler calls of this subscriber that raised.",
    ),
    "queued": (
        "tapd_subscriber_queued_taps",
        False,
        "Taps queued for this subscriber, not yet sent.",
    ),
    "in_flight": (
        "tapd_subscriber_in_flight_taps",
        False,
        "Taps sent to this subscriber and not yet acknowledged.",
    ),
    "held_bytes": (
        "tapd_subscriber_held_bytes",
        False,
        "Bytes queued and in flight for "
        "this subscriber: its queue fill, out of tapd_queue_limit_bytes.",
    ),
    "spooled": (
        "tapd_subscriber_spooled_taps",
        False,
        "Taps waiting in this subscriber's on-disk spool.",
    ),
    "spool_bytes": (
        "tapd_subscriber_spool_bytes",
        False,
        "Bytes of this subscriber's on-disk spool.",
    ),
    "last_handled_time": (
        "tapd_last_handled_tap_timestamp_seconds",
        False,
        "Emitter "
        "time (meta.time, seconds since the epoch, on the emitter's "
        "clock) of the last tap this subscriber handled; lag is "
        "time() minus this. Absent until it has handled one.",
    ),
}
# Per worker pool (labels `group`, `consumers`): field -> (name, counter?, help).
GROUP_METRICS = {
    "delivered": (
        "tapd_group_taps_handled",
        True,
        "Taps the members of this worker pool handled (acknowledged), each tap once.",
    ),
    "redelivered": (
        "tapd_group_taps_redelivered",
        True,
        "Taps a member of this pool left "
        "unacknowledged (it died, or went silent) and another member was given.",
    ),
    "dropped": (
        "tapd_group_taps_dropped",
        True,
        "Taps for this pool dropped because its queue was full.",
    ),
    "errors": (
        "tapd_group_handler_errors",
        True,
        "Handler calls of this pool's members that raised.",
    ),
    "queued": (
        "tapd_group_queued_taps",
        False,
        "Taps queued for this pool, not yet given to a member.",
    ),
    "in_flight": (
        "tapd_group_in_flight_taps",
        False,
        "Taps given to a member of this pool and not yet acknowledged.",
    ),
    "member_count": ("tapd_group_members", False, "Members of this worker pool."),
}
# Per shared-memory ring (label `ring`, its file name): field -> (name, counter?, help).
RING_METRICS = {
    "taps": ("tapd_ring_taps_written", True, "Taps the emitter wrote to this ring."),
    "dropped": (
        "tapd_ring_taps_dropped",
        True,
        "Taps the emitter dropped because this ring was full.",
    ),
    "abandoned": (
        "tapd_ring_records_abandoned",
        True,
        "Records of this ring abandoned unfinished by their writer.",
    ),
    "committed": ("tapd_ring_committed_bytes", True, "Bytes the emitter committed to this ring."),
    "released": (
        "tapd_ring_released_bytes",
        True,
        "Bytes of this ring the daemon "
        "released back to the emitter; committed minus released is its fill.",
    ),
    "capacity": ("tapd_ring_capacity_bytes", False, "Size of this ring."),
    "skipped": (
        "tapd_ring_taps_skipped",
        True,
        "Taps the emitter did not copy to this ring: dormant site, or sampled out.",
    ),
}
FORWARD_METRICS = {
    "window_bytes": (
        "tapd_forward_window_bytes",
        "Bytes the upstream daemon lets this one have in flight.",
    ),
    "in_flight_bytes": (
        "tapd_forward_in_flight_bytes",
        "Bytes sent upstream and not yet credited back.",
    ),
    "waiting": ("tapd_forward_waiting_taps", "Taps waiting to be sent upstream."),
    "waiting_bytes": ("tapd_forward_waiting_bytes", "Bytes of taps waiting to be sent upstream."),
    "unconfirmed": (
        "tapd_forward_unconfirmed_taps",
        "Taps sent upstream whose outcome the upstream has not reported yet.",
    ),
    "held": ("tapd_forward_held_taps", "Taps kept until the upstream confirms them."),
    "silent_s": (
        "tapd_forward_silence_seconds",
        "Seconds since the upstream daemon was last heard from.",
    ),
}


class Snapshots:
    """Stats for the HTTP server's threads, built by the daemon's loop (module docstring)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._requests: queue.SimpleQueue[Future[Stats]] = queue.SimpleQueue()
        self._wake = wake

    def get(self, timeout: float = SCRAPE_TIMEOUT) -> Stats:
        """On an HTTP thread: the daemon's stats now. Raises TimeoutError when the loop
        does not answer in time (it has stopped)."""
        future: Future[Stats] = Future()
        self._requests.put(future)
        self._wake()
        return future.result(timeout)

    def answer(self, build: Callable[[], Stats]) -> None:
        """On the daemon's loop, once a round: one snapshot for every scrape waiting."""
        if self._requests.empty():
            return
        stats = build()
        while True:
            try:
                future = self._requests.get_nowait()
            except queue.Empty:
                return
            future.set_result(stats)

    def refuse(self) -> None:
        """The loop has ended: fail whatever still waits."""
        while True:
            try:
                future = self._requests.get_nowait()
            except queue.Empty:
                return
            future.set_exception(TimeoutError("the tapd daemon is shutting down"))


def families(stats: Stats) -> Iterator[Any]:
    """The metric families of one stats snapshot (`tapd status --json`)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def counter(name: str, text: str, labels: tuple[str, ...] = ()) -> Any:
        return CounterMetricFamily(name, text, labels=labels)

    def gauge(name: str, text: str, labels: tuple[str, ...] = ()) -> Any:
        return GaugeMetricFamily(name, text, labels=labels)

    info = gauge("tapd_daemon_info", "Always 1: the daemon's id and pid.", ("daemon", "pid"))
    info.add_metric([str(stats.get("daemon", "")), str(stats.get("pid", ""))], 1)
    yield info
    counters = dict(stats.get("counters", {}))
    rejected = counter(
        "tapd_messages_rejected",
        "Messages refused because they broke the wire protocol, by reason.",
        ("reason",),
    )
    for key, value in sorted(counters.items()):
        if key.startswith(REJECTED):
            rejected.add_metric([key.removeprefix(REJECTED)], value)
    yield rejected
    for key, (name, text) in COUNTERS.items():  # always present, from 0: rate() works
        family = counter(name, text)
        family.add_metric([], counters.get(key, 0))
        yield family
    for key, value in sorted(counters.items()):  # counters added since this table was
        if key not in COUNTERS and not key.startswith(REJECTED):
            family = counter(
                f"tapd_{_metric_name(key)}", f"The daemon counter {key} of `tapd status --json`."
            )
            family.add_metric([], value)
            yield family
    emitters, subscribers = stats.get("emitters", []), stats.get("subscribers", [])
    for name, text, count in (
        ("tapd_emitters", "Emitters connected (or whose rings are attached).", len(emitters)),
        ("tapd_subscribers", "Subscribers connected.", len(subscribers)),
    ):
        family = gauge(name, text)
        family.add_metric([], count)
        yield family
    limit = gauge("tapd_queue_limit_bytes", "Bound of each subscriber's queue (--queue-bytes).")
    limit.add_metric([], stats.get("queue_bytes") or 0)
    yield limit
    yield from _per_peer(
        EMITTER_METRICS, emitters, ("emitter",), lambda e: (e["name"],), counter, gauge
    )
    yield from _per_peer(
        SUBSCRIBER_METRICS,
        subscribers,
        ("subscriber", "consumers"),
        lambda s: (s["name"], ",".join(s["consumers"])),
        counter,
        gauge,
    )
    groups = [{**g, "member_count": len(g["members"])} for g in stats.get("groups", [])]
    yield from _per_peer(
        GROUP_METRICS,
        groups,
        ("group", "consumers"),
        lambda g: (g["group"], ",".join(g["consumers"])),
        counter,
        gauge,
    )
    rings = stats.get("rings", [])
    yield from _per_peer(
        RING_METRICS, rings, ("ring",), lambda r: (r["path"].rpartition("/")[2],), counter, gauge
    )
    blocked = counter(
        "tapd_ring_writer_blocked_seconds",
        "Time the emitter spent waiting for room in this ring.",
        ("ring",),
    )
    for ring in rings:
        blocked.add_metric([ring["path"].rpartition("/")[2]], ring.get("blocked_ns", 0) / 1e9)
    yield blocked
    skipped = counter(
        "tapd_consumer_taps_skipped",
        "Taps of this consumer the emitter did not copy: dormant site, or sampled out.",
        ("ring", "consumer"),
    )
    for ring in rings:
        for consumer, count in ring.get("skipped_by_consumer", {}).items():
            skipped.add_metric([ring["path"].rpartition("/")[2], consumer], count)
    yield skipped
    if forward := stats.get("forward"):
        for key, (name, text) in FORWARD_METRICS.items():
            if isinstance(forward.get(key), (int, float)):
                family = gauge(name, text)
                family.add_metric([], forward[key])
                yield family


def _per_peer(
    table: dict[str, tuple[str, bool, str]],
    peers: list[dict[str, Any]],
    labels: tuple[str, ...],
    label_values: Callable[[dict[str, Any]], tuple[str, ...]],
    counter: Callable[..., Any],
    gauge: Callable[..., Any],
) -> Iterator[Any]:
    for key, (name, is_counter, text) in table.items():
        # Two peers may share a name (a subscriber that reconnected before the daemon
        # dropped its old connection): one series each name, summed, as Prometheus needs.
        values: dict[tuple[str, ...], float] = {}
        for peer in peers:
            value = peer.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                labelled = label_values(peer)
                if key == "last_handled_time":  # a timestamp: the newest, not a sum
                    values[labelled] = max(values.get(labelled, value), value)
                else:
                    values[labelled] = values.get(labelled, 0) + value
        family = (counter if is_counter else gauge)(name, text, labels)
        for labelled, value in values.items():
            family.add_metric(list(labelled), value)
        yield family


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class MetricsServer:
    """The HTTP server of `--metrics`, on threads of its own; `url` is where it serves."""

    def __init__(self, address: str, snapshots: Snapshots) -> None:
        try:
            from prometheus_client import start_http_server
            from prometheus_client.registry import CollectorRegistry
        except ImportError as exc:
            raise ConfigError(
                f"--metrics {address} needs the prometheus-client package: "
                "pip install 'tapd[metrics]'"
            ) from exc
        host, port = metrics_address(address)
        registry = CollectorRegistry(auto_describe=False)  # tapd_ metrics only
        registry.register(_Collector(snapshots))
        try:
            self._server, self._thread = start_http_server(port, host, registry=registry)
        except OSError as exc:
            why = (
                f"port {port} is in use by another process"
                if exc.errno == errno.EADDRINUSE
                else exc.strerror or str(exc)
            )
            raise OSError(f"--metrics {address}: cannot listen there: {why}") from exc
        bound = self._server.server_address[0]
        shown = bound if isinstance(bound, str) else bound.decode()
        shown = f"[{shown}]" if ":" in shown else shown  # an IPv6 address
        self.url = f"http://{shown}:{self._server.server_port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Collector:
    def __init__(self, snapshots: Snapshots) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Any]:
        yield from families(self._snapshots.get())
