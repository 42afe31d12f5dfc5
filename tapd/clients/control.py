"""A one-shot client for the daemon's control messages (`stats`, `shutdown`)."""

from __future__ import annotations

from typing import Any

import zmq

from tapd.errors import ProtocolError
from tapd.protocol import decode, encode
from tapd.security import secure_client


def request(endpoint: str, kind: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """Send one control message; return the reply header (None for `shutdown`).
    Raises TimeoutError if the daemon does not answer within `timeout` seconds."""
    context: zmq.Context[Any] = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        secure_client(sock, endpoint)
        sock.connect(endpoint)
        sock.send_multipart(encode(kind, {}))
        if kind == "shutdown":
            sock.setsockopt(zmq.LINGER, int(timeout * 1000))
            return None
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no tapd daemon answered at {endpoint} within {timeout} s")
        try:
            return decode(sock.recv_multipart()).header
        except ProtocolError as exc:
            raise TimeoutError(f"the daemon at {endpoint} answered nonsense: {exc}") from exc
    finally:
        sock.close()


def stats(endpoint: str, timeout: float = 2.0) -> dict[str, Any]:
    reply = request(endpoint, "stats", timeout)
    assert reply is not None
    return dict(reply["stats"])
